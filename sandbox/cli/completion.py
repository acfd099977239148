"""`sandbox completion bash|zsh|fish`: a shell completion script, made from the parser.

The script is static: it lists every verb, nested verb, option, option value and the
bundled profiles' names as they are in this version, so a TAB never starts Python.
Load it once per shell (or install it, see the help); run the command again after an
upgrade. zsh uses the bash script through zsh's own ``bashcompinit``.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

from sandbox.profile.bundled import bundled

SHELLS = ("bash", "zsh", "fish")
HELP = """\
Print a completion script for SHELL on stdout. Load it in the running shell, or
install it so every new shell has it:

  bash   source <(sandbox completion bash)
         sandbox completion bash > /etc/bash_completion.d/sandbox
  zsh    source <(sandbox completion zsh)          (in ~/.zshrc after compinit)
  fish   sandbox completion fish | source
         sandbox completion fish > ~/.config/fish/completions/sandbox.fish

It completes verbs, nested verbs, options and their values, and profiles (the bundled
ones by name, and files). It is made from this version's commands: run it again after
an upgrade.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("completion", help="print a shell completion script (bash, zsh, fish)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=run)


@dataclass
class Level:
    """What may follow the words ``path`` (`sandbox` and the verbs after it)."""

    path: str
    subs: dict[str, str] = field(default_factory=dict)  # nested verb -> its help
    flags: list[tuple[str, str]] = field(default_factory=list)  # (option, help)
    values: dict[str, list[str] | None] = field(default_factory=dict)  # option -> choices
    words: list[str] = field(default_factory=list)  # positional choices
    profile: bool = False  # a positional PROFILE
    files: bool = False  # another positional: paths


def levels(parser: argparse.ArgumentParser, path: str = "sandbox") -> list[Level]:
    level = Level(path)
    out = [level]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, nested in action.choices.items():
                level.subs[name] = helps.get(name, "")
                out += levels(nested, f"{path} {name}")
        elif action.option_strings:
            if action.help == argparse.SUPPRESS:
                continue
            for opt in action.option_strings:
                level.flags.append((opt, action.help or ""))
                if action.nargs != 0:
                    level.values[opt] = ([str(c) for c in action.choices]
                                         if action.choices else None)
        elif action.dest in ("profile", "profiles"):
            level.profile = True
        elif action.choices:
            level.words += [str(c) for c in action.choices]
        else:
            level.files = True
    return out


def bash_script(all_levels: list[Level], profiles: list[str]) -> str:
    def assoc(name: str, items: dict[str, str]) -> str:
        body = "\n".join(f"    [{shlex.quote(k)}]={shlex.quote(v)}" for k, v in items.items())
        return f"_sandbox_{name}=(\n{body}\n)"

    subs = {lv.path: " ".join(lv.subs) for lv in all_levels if lv.subs}
    opts = {lv.path: " ".join(o for o, _ in lv.flags) for lv in all_levels}
    vals = {f"{lv.path}|{o}": " ".join(c or []) for lv in all_levels for o, c in lv.values.items()}
    pos = {lv.path: "profile" if lv.profile else "file" if lv.files else " ".join(lv.words)
           for lv in all_levels}
    return f"""\
# sandbox completion for bash and zsh (`sandbox completion --help`)
if [ -n "${{ZSH_VERSION-}}" ]; then
    autoload -U +X bashcompinit && bashcompinit
fi
typeset -A _sandbox_subs _sandbox_opts _sandbox_vals _sandbox_pos
_sandbox_profiles={shlex.quote(" ".join(profiles))}
{assoc("subs", subs)}
{assoc("opts", opts)}
{assoc("vals", vals)}
{assoc("pos", pos)}
_sandbox() {{
    [ -n "${{ZSH_VERSION-}}" ] && setopt local_options ksh_arrays
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    local path=sandbox word i
    for ((i = 1; i < COMP_CWORD; i++)); do
        word="${{COMP_WORDS[i]}}"
        case " ${{_sandbox_subs[$path]-}} " in
            *" $word "*) path="$path $word" ;;
        esac
    done
    if [ -n "${{_sandbox_vals[$path|$prev]+set}}" ]; then
        if [ -n "${{_sandbox_vals[$path|$prev]}}" ]; then
            COMPREPLY=($(compgen -W "${{_sandbox_vals[$path|$prev]}}" -- "$cur"))
        else
            COMPREPLY=($(compgen -f -- "$cur"))
        fi
        return 0
    fi
    case "$cur" in
        -*) COMPREPLY=($(compgen -W "${{_sandbox_opts[$path]-}}" -- "$cur")); return 0 ;;
    esac
    local words="${{_sandbox_subs[$path]-}}"
    case "${{_sandbox_pos[$path]-}}" in
        profile) COMPREPLY=($(compgen -W "$words $_sandbox_profiles" -- "$cur")
                            $(compgen -f -- "$cur")) ;;
        file) COMPREPLY=($(compgen -W "$words" -- "$cur") $(compgen -f -- "$cur")) ;;
        *) COMPREPLY=($(compgen -W "$words ${{_sandbox_pos[$path]-}}" -- "$cur")) ;;
    esac
    return 0
}}
complete -o filenames -F _sandbox sandbox
"""


def fish_script(all_levels: list[Level], profiles: list[str]) -> str:
    def q(text: str) -> str:
        return shlex.quote(text.replace("\n", " "))

    def var(path: str) -> str:
        return "__sandbox_subs_" + path.replace(" ", "_").replace("-", "_")

    lines = [
        "# sandbox completion for fish (`sandbox completion --help`)",
        "complete -c sandbox -e",
        "complete -c sandbox -f",
    ]
    for lv in all_levels:
        if lv.subs:
            lines.append(f"set -g {var(lv.path)} {' '.join(q(s) for s in lv.subs)}")
    lines += [
        "function __sandbox_path",
        "    set -l path sandbox",
        "    for word in (commandline -opc)[2..-1]",
        "        set -l subs __sandbox_subs_(string replace -a -- ' ' _ $path "
        "| string replace -a -- - _)",
        "        if set -q $subs; and contains -- $word $$subs",
        "            set path \"$path $word\"",
        "        end",
        "    end",
        "    echo $path",
        "end",
    ]
    for lv in all_levels:
        when = f"-n {q(f'test (__sandbox_path) = {q(lv.path)}')}"
        for name, text in lv.subs.items():
            lines.append(f"complete -c sandbox {when} -a {q(name)} -d {q(text)}")
        for opt, text in lv.flags:
            flag = f"-l {q(opt[2:])}" if opt.startswith("--") else f"-s {q(opt[1:])}"
            if opt not in lv.values:
                value = ""
            elif lv.values[opt]:
                value = f" -x -a {q(' '.join(lv.values[opt] or []))}"
            else:
                value = " -r -F"
            lines.append(f"complete -c sandbox {when} {flag}{value} -d {q(text)}")
        if lv.profile:
            lines.append(f"complete -c sandbox {when} -F -a {q(' '.join(profiles))} "
                         f"-d 'bundled profile'")
        elif lv.files:
            lines.append(f"complete -c sandbox {when} -F")
        elif lv.words:
            lines.append(f"complete -c sandbox {when} -a {q(' '.join(lv.words))}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from sandbox.cli import build_parser

    all_levels = levels(build_parser(every_verb=True))
    profiles = list(bundled())
    script = fish_script if args.shell == "fish" else bash_script
    print(script(all_levels, profiles), end="")
    return 0
