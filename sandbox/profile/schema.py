"""The profile's JSON Schema, generated from the model so it is never maintained twice.

Beyond what the model checks, each catalogue device type's ``model`` lists the models the
catalogue knows (``catalogue``), so that editors complete and check it: an ``enum`` of every
model of the type (what an editor offers), and one ``if vendor: X then model: <X's
models>`` per vendor (what it checks a pair against). The ``generic`` type's ``model`` is
free text and stays so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sandbox.profile import catalogue, model

# Device type (its model class) -> vendor -> model name -> catalogue entry.
CATALOGUED: tuple[tuple[type[model.DeviceBase], Mapping[str, Mapping[str, object]]], ...] = (
    (model.Gpu, catalogue.GPUS), (model.Nic, catalogue.NICS), (model.Fpga, catalogue.FPGAS),
    (model.Nvme, catalogue.NVMES),
)


def profile_schema() -> dict[str, Any]:
    schema = model.Profile.model_json_schema(by_alias=True, mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "HardwareProfile"
    schema["description"] = (
        f"A hw-sandbox hardware profile ({model.API_VERSION}). Known device models: "
        + "; ".join(
            f"{kind} {vendor}: {', '.join(sorted(models))}"
            for kind, table in (("gpu", catalogue.GPUS), ("nic", catalogue.NICS),
                                ("fpga", catalogue.FPGAS))
            for vendor, models in table.items()
        )
    )
    for cls, table in CATALOGUED:
        _enumerate_models(schema["$defs"][cls.__name__], table)
    return schema


def _enumerate_models(device: dict[str, Any], table: Mapping[str, Mapping[str, object]]
                      ) -> None:
    by_vendor = {vendor: sorted(models) for vendor, models in table.items()}
    device["properties"]["model"] = {
        "title": "Model",
        "type": "string",
        "enum": sorted({name for names in by_vendor.values() for name in names}),
        "description": "a catalogue model of the vendor: " + "; ".join(
            f"{vendor}: {', '.join(names)}" for vendor, names in by_vendor.items()),
    }
    device["allOf"] = [
        {"if": {"properties": {"vendor": {"const": vendor}}, "required": ["vendor"]},
         "then": {"properties": {"model": {"enum": names}}}}
        for vendor, names in by_vendor.items()
    ]


def schema_text() -> str:
    return json.dumps(profile_schema(), indent=2, sort_keys=True) + "\n"
