"""The profile's JSON Schema, generated from the model so it is never maintained twice."""

from __future__ import annotations

import json
from typing import Any

from sandbox.profile import catalogue, model


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
    return schema


def schema_text() -> str:
    return json.dumps(profile_schema(), indent=2, sort_keys=True) + "\n"
