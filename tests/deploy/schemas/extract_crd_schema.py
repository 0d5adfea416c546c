"""Write the OpenAPI schema of one version of a CustomResourceDefinition as JSON.

    python tests/deploy/schemas/extract_crd_schema.py CRD.yaml VERSION OUT.json

The schema is kept as the CRD states it (``openAPIV3Schema``); tests/deploy/
test_manifests.py makes it strict when it loads it. See README.md beside this file for
where the committed schema came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def main(crd_path: str, version: str, out: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text(encoding="utf-8"))
    if crd.get("kind") != "CustomResourceDefinition":
        raise SystemExit(f"{crd_path} is not a CustomResourceDefinition")
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            schema = entry["schema"]["openAPIV3Schema"]
            break
    else:
        raise SystemExit(f"{crd_path} has no version {version!r}")
    Path(out).write_text(
        json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8"
    )


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
