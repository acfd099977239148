"""A ``CheckReport`` as JUnit XML, for CI (``sandbox kubelet check --junit FILE``).

One ``<testsuites>`` holding one ``<testsuite name="sandbox-kubelet-check">``, one
``<testcase>`` per check (classname ``sandbox-kubelet-check``, its time): a failed check
has a ``<failure message=...>``, a check not run a ``<skipped message=...>``. The suite's
``<properties>`` say what was graded (the plugin command, and the profile and node where
one was served); its ``<system-out>`` holds the protocol log and the plugin's output. The
shape Jenkins, GitLab, GitHub's test reporters and pytest's own ``--junitxml`` agree on;
characters XML 1.0 cannot carry (a plugin's colour escapes) are written as ``\\xNN``.
"""

from __future__ import annotations

import re
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping

from sandbox.kubelet.conformance import FAIL, NOT_RUN, CheckReport

SUITE = "sandbox-kubelet-check"
# What XML 1.0 allows: tab, newline, carriage return and U+0020 up, less the surrogates
# and U+FFFE/U+FFFF.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _text(value: str) -> str:
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", value)


def junit_xml(report: CheckReport, properties: Mapping[str, str] | None = None,
              *, started: float | None = None) -> bytes:
    """The report as a JUnit XML document (UTF-8, with its declaration). ``started``: the
    run's start (time.time()), the suite's timestamp; now when not given."""
    results = report.results
    counts = {
        "tests": str(len(results)),
        "failures": str(sum(r.status == FAIL for r in results)),
        "errors": "0",
        "skipped": str(sum(r.status == NOT_RUN for r in results)),
        "time": f"{sum(r.seconds for r in results):.3f}",
    }
    top = ET.Element("testsuites", {"name": SUITE, **counts})
    suite = ET.SubElement(top, "testsuite", {
        "name": SUITE, **counts,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S",
                                   time.localtime(time.time() if started is None else started)),
        "hostname": socket.gethostname(),
    })
    if properties:
        props = ET.SubElement(suite, "properties")
        for name, value in properties.items():
            ET.SubElement(props, "property", {"name": name, "value": _text(value)})
    for r in results:
        case = ET.SubElement(suite, "testcase", {"classname": SUITE, "name": r.name,
                                                 "time": f"{r.seconds:.3f}"})
        if r.status == FAIL:
            ET.SubElement(case, "failure", {"message": _text(r.message),
                                            "type": "CheckFailed"}).text = _text(r.message)
        elif r.status == NOT_RUN:
            ET.SubElement(case, "skipped", {"message": _text(r.message)})
    out = ["--- protocol log ---", *(str(e) for e in report.events),
           "--- plugin output ---", report.plugin_output.rstrip("\n")]
    ET.SubElement(suite, "system-out").text = _text("\n".join(out) + "\n")
    ET.indent(top)
    body: bytes = ET.tostring(top, encoding="utf-8", xml_declaration=True)
    return body + b"\n"
