"""Run one metadata service instance for the group tests (a subprocess, so it can be SIGKILLed).

Usage: python groups_serve.py PORT CONFIG_JSON (ServiceConfig fields; real backends).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import uvicorn

from metadata_service import ServiceConfig, create_app

port, raw = int(sys.argv[1]), json.loads(sys.argv[2])
raw["run_dir"] = Path(raw["run_dir"])
uvicorn.run(create_app(ServiceConfig(**raw)), host="127.0.0.1", port=port, log_level="warning")
