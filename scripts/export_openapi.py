"""Write the services' OpenAPI schemas to docs/openapi/ (tests check they are current).

    .venv/bin/python scripts/export_openapi.py
"""

import json
from pathlib import Path

from astranb.services import rollout_app, trainer_app

OUT = Path(__file__).resolve().parent.parent / "docs" / "openapi"


def schemas() -> dict[str, dict]:
    return {"rollout.json": rollout_app.create_app().openapi(),
            "trainer.json": trainer_app.create_app().openapi()}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, schema in schemas().items():
        (OUT / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(f"wrote {OUT / name} ({len(schema['paths'])} paths)")


if __name__ == "__main__":
    main()
