"""The ``torch`` backend's model: a Qwen3-architecture decoder written as functions over a flat
state dict with Hugging Face parameter names.

The state dict is the model: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
… exactly the names of a Hugging Face Qwen3 checkpoint, so a safetensors load, a refit broadcast
(names from ``prepare``) and a random init all address the same tensors. There is no
``nn.Module``: the forward pass is :func:`prefill` (a prompt's new tokens after an optional cached
prefix) and :func:`decode_step` (one token for each of several sequences at once, attention batched), both writing
into a per-sequence KV tensor of layout ``[layers, 2, kv_heads, capacity, head_dim]``.

Numerics follow transformers' ``Qwen3ForCausalLM`` (RMSNorm in float32, rotate-half RoPE, q/k
norms before RoPE, SwiGLU MLP); ``tests/gpu`` compares logits with transformers' own model.

Models: a Hugging Face directory (``config.json`` + ``*.safetensors``) or ``random:<size>``,
a seeded random init of a named size (:data:`SIZES`), since no weights can be downloaded here.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
import torch.nn.functional as F
from drs_protocol.enums import Precision

from drs_engine.errors import WeightsLoadError

RANDOM_PREFIX: Final = "random:"
#: Standard deviation of the random init (transformers' ``initializer_range``).
INIT_STD: Final = 0.02
DTYPES: Final = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a Qwen3 ``config.json`` says about the tensors (and nothing else)."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = True
    max_positions: int = 40960

    def kv_bytes_per_token(self, dtype: Any) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * _itemsize(dtype)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` transformers reads as ``Qwen3ForCausalLM``."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_positions,
            "hidden_act": "silu",
            "attention_bias": False,
        }


#: ``random:<size>`` models. The vocabulary is Qwen3's (the shipped tokenizer's ids fit). The
#: output embedding is its own tensor: tied to a random input embedding, the residual stream makes
#: greedy decoding repeat the last prompt token whatever the seed, and tests could not tell
#: weights apart by their tokens. ``0.6b`` has Qwen3-0.6B's layer shapes (0.75B parameters untied).
SIZES: Final = {
    "tiny": ModelShape(
        151936, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, tie_embeddings=False
    ),
    "small": ModelShape(
        151936, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768, tie_embeddings=False
    ),
    "0.6b": ModelShape(
        151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, tie_embeddings=False
    ),
}


def _itemsize(dtype: Any) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


def parse_dtype(name: str) -> Any:
    key = name.removeprefix("torch.")
    if key == Precision.AUTO:
        key = Precision.BFLOAT16
    if key not in DTYPES:
        raise ValueError(f"model.precision: the torch backend serves {', '.join(DTYPES)} or auto, not {name!r}")
    return DTYPES[key]


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """The shape of a Qwen3 ``config.json`` (transformers 4 or 5 layout); other architectures are refused."""
    model_type = config.get("model_type")
    if model_type != "qwen3":
        raise WeightsLoadError(
            f"config.json: model_type {model_type!r} is not served by the torch backend (qwen3 only)"
        )
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
    heads = int(config["num_attention_heads"])
    return ModelShape(
        vocab_size=int(config["vocab_size"]),
        hidden=int(config["hidden_size"]),
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        intermediate=int(config["intermediate_size"]),
        rope_theta=float(theta),
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_positions=int(config.get("max_position_embeddings", 40960)),
    )


def expected_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in a fixed order (the refit broadcast order)."""
    h, d = shape.hidden, shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (shape.heads * d, h)
        out[p + "self_attn.k_proj.weight"] = (shape.kv_heads * d, h)
        out[p + "self_attn.v_proj.weight"] = (shape.kv_heads * d, h)
        out[p + "self_attn.o_proj.weight"] = (h, shape.heads * d)
        out[p + "self_attn.q_norm.weight"] = (d,)
        out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (shape.intermediate, h)
        out[p + "mlp.up_proj.weight"] = (shape.intermediate, h)
        out[p + "mlp.down_proj.weight"] = (h, shape.intermediate)
    out["model.norm.weight"] = (h,)
    if not shape.tie_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    return out


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest(), "little") >> 1


def random_state_dict(shape: ModelShape, *, seed: int, device: Any, dtype: Any) -> dict[str, Any]:
    """A seeded random init: each tensor from its own generator (seed, name), so the same seed
    gives the same weights in any process on the same kind of device."""
    params: dict[str, Any] = {}
    for name, dims in expected_shapes(shape).items():
        if name.endswith("norm.weight"):
            params[name] = torch.ones(dims, device=device, dtype=dtype)
            continue
        gen = torch.Generator(device=device)
        gen.manual_seed(_name_seed(seed, name))
        t = torch.randn(dims, generator=gen, device=device, dtype=torch.float32)
        params[name] = (t * INIT_STD).to(dtype)
    return params


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model comes from: ``random:<size>[@seed]`` or a Hugging Face directory."""

    label: str
    shape: ModelShape
    random_seed: int | None
    directory: Path | None


def resolve_model(path: str) -> ModelSource:
    """Parse ``model.path`` (``random:tiny``, ``random:0.6b@7``, or a directory with ``config.json``)."""
    if path.startswith(RANDOM_PREFIX):
        spec = path[len(RANDOM_PREFIX) :]
        name, _, seed_text = spec.partition("@")
        if name not in SIZES:
            raise ValueError(f"model.path: random size {name!r} is not one of {', '.join(SIZES)}")
        try:
            seed = int(seed_text) if seed_text else 0
        except ValueError:
            raise ValueError(f"model.path: the seed after '@' must be an integer, got {seed_text!r}") from None
        return ModelSource(label=path, shape=SIZES[name], random_seed=seed, directory=None)
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model.path: {path!r} is neither random:<size> nor a directory holding config.json")
    shape = shape_from_hf_config(json.loads(config_file.read_text(encoding="utf-8")))
    return ModelSource(label=path, shape=shape, random_seed=None, directory=directory)


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (a file, or a directory of them); WeightsLoadError if none."""
    root = Path(path)
    if root.is_file():
        return [root]
    if root.is_dir():
        files = sorted(root.glob("*.safetensors"))
        if files:
            return files
        raise WeightsLoadError(f"weights directory {str(path)!r} holds no *.safetensors file", param="path")
    raise WeightsLoadError(f"weights path {str(path)!r} does not exist", param="path")


def read_safetensors(path: str | Path, shape: ModelShape, device: Any, dtype: Any) -> dict[str, Any]:
    """Every parameter of ``shape`` from a checkpoint, checked by name and shape (extra tensors,
    like a tied ``lm_head``, are ignored; a missing or misshaped one is a WeightsLoadError)."""
    from safetensors.torch import load_file

    wanted = expected_shapes(shape)
    found: dict[str, Any] = {}
    for file in safetensors_files(path):
        try:
            tensors = load_file(str(file), device=str(device))
        except Exception as exc:
            raise WeightsLoadError(f"cannot read {str(file)!r}: {exc}", param="path") from exc
        for name, tensor in tensors.items():
            if name in wanted:
                found[name] = tensor
    missing = [n for n in wanted if n not in found]
    if missing:
        raise WeightsLoadError(
            f"checkpoint {str(path)!r} lacks {len(missing)} tensors, e.g. {missing[0]!r}", param="path"
        )
    for name, dims in wanted.items():
        if tuple(found[name].shape) != dims:
            raise WeightsLoadError(
                f"checkpoint {str(path)!r}: {name} has shape {tuple(found[name].shape)}, the model needs {dims}",
                param="path",
            )
    return {name: found[name].to(dtype) for name in wanted}


# ---- forward ---------------------------------------------------------------------------------


def _rms(x: Any, weight: Any, eps: float) -> Any:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_tables(positions: Any, shape: ModelShape, dtype: Any) -> tuple[Any, Any]:
    """cos and sin ``[tokens, 1, head_dim]`` for ``positions`` (rotate-half RoPE, as transformers),
    computed once per forward pass and shared by every layer."""
    d = shape.head_dim
    device = positions.device
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _rope(x: Any, rope: tuple[Any, Any]) -> Any:
    """``x``: [tokens, heads, head_dim]."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _qkv(params: dict[str, Any], i: int, x: Any, rope: tuple[Any, Any], shape: ModelShape) -> tuple[Any, Any, Any]:
    p = f"model.layers.{i}.self_attn."
    n = x.shape[0]
    d = shape.head_dim
    q = (x @ params[p + "q_proj.weight"].T).view(n, shape.heads, d)
    k = (x @ params[p + "k_proj.weight"].T).view(n, shape.kv_heads, d)
    v = (x @ params[p + "v_proj.weight"].T).view(n, shape.kv_heads, d)
    q = _rope(_rms(q, params[p + "q_norm.weight"], shape.rms_eps), rope)
    k = _rope(_rms(k, params[p + "k_norm.weight"], shape.rms_eps), rope)
    return q, k, v


def _mlp(params: dict[str, Any], i: int, x: Any) -> Any:
    p = f"model.layers.{i}.mlp."
    return (F.silu(x @ params[p + "gate_proj.weight"].T) * (x @ params[p + "up_proj.weight"].T)) @ params[
        p + "down_proj.weight"
    ].T


def _lm_head(params: dict[str, Any], shape: ModelShape) -> Any:
    return params["model.embed_tokens.weight" if shape.tie_embeddings else "lm_head.weight"]


def new_kv(shape: ModelShape, capacity: int, *, device: Any, dtype: Any) -> Any:
    """An empty KV tensor for one sequence: ``[layers, 2, kv_heads, capacity, head_dim]``."""
    return torch.empty((shape.layers, 2, shape.kv_heads, capacity, shape.head_dim), device=device, dtype=dtype)


def _prefill(params: dict[str, Any], shape: ModelShape, ids: Sequence[int], kv: Any, start: int) -> Any:
    """Compute ``ids`` at positions ``start…``, attending to the ``start`` tokens already in ``kv``;
    writes their K/V into ``kv`` and returns the float32 logits of the last position ``[vocab]``."""
    device = kv.device
    n = len(ids)
    tokens = torch.tensor(list(ids), device=device, dtype=torch.long)
    positions = torch.arange(start, start + n, device=device)
    x = params["model.embed_tokens.weight"][tokens]
    rope = rope_tables(positions, shape, x.dtype)
    mask = None
    if start > 0:  # the new tokens see the whole cached prefix, then causally among themselves
        rows = torch.arange(n, device=device)[:, None] + start
        mask = torch.arange(start + n, device=device)[None, :] <= rows
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        h = _rms(x, params[p + "input_layernorm.weight"], shape.rms_eps)
        q, k, v = _qkv(params, i, h, rope, shape)
        kv[i, 0, :, start : start + n] = k.transpose(0, 1)
        kv[i, 1, :, start : start + n] = v.transpose(0, 1)
        group = shape.heads // shape.kv_heads  # GQA: each K/V head serves `group` query heads
        keys = kv[i, 0, :, : start + n].repeat_interleave(group, dim=0).unsqueeze(0)
        values = kv[i, 1, :, : start + n].repeat_interleave(group, dim=0).unsqueeze(0)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, is_causal=mask is None
        )
        x = x + attn[0].transpose(0, 1).reshape(n, -1) @ params[p + "self_attn.o_proj.weight"].T
        x = x + _mlp(params, i, _rms(x, params[p + "post_attention_layernorm.weight"], shape.rms_eps))
    last = _rms(x[-1:], params["model.norm.weight"], shape.rms_eps)
    return (last @ _lm_head(params, shape).T)[0].to(torch.float32)


def _prefill_batch(
    params: dict[str, Any], shape: ModelShape, prompts: Sequence[Sequence[int]], kvs: Sequence[Any]
) -> Any:
    """Cold prefills of several prompts in one forward pass: prompt ``b``'s K/V into ``kvs[b]``
    (positions ``0 … len-1``). The prompts are right-padded to the longest, ``L``, and run as one
    ``[batch, L]`` pass: every matmul over all ``batch * L`` rows, attention one causal call per
    layer (right padding keeps causal attention exact: a real token sees only earlier positions, all
    real). Returns float32 logits ``[batch, vocab]`` of each prompt's last token."""
    device = kvs[0].device
    b, longest = len(prompts), max(len(ids) for ids in prompts)
    group = shape.heads // shape.kv_heads
    padded = torch.zeros((b, longest), dtype=torch.long)
    for j, ids in enumerate(prompts):
        padded[j, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    x = params["model.embed_tokens.weight"][padded.to(device).view(-1)]  # [b * L, hidden]
    rope = rope_tables(torch.arange(longest, device=device).repeat(b), shape, x.dtype)
    written = torch.empty((shape.layers, 2, b, shape.kv_heads, longest, shape.head_dim), device=device, dtype=x.dtype)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        h = _rms(x, params[p + "input_layernorm.weight"], shape.rms_eps)
        q, k, v = _qkv(params, i, h, rope, shape)  # [b * L, heads, d]
        written[i, 0] = k.view(b, longest, shape.kv_heads, shape.head_dim).transpose(1, 2)
        written[i, 1] = v.view(b, longest, shape.kv_heads, shape.head_dim).transpose(1, 2)
        queries = q.view(b, longest, shape.heads, shape.head_dim).transpose(1, 2)
        keys = written[i, 0].repeat_interleave(group, dim=1)
        values = written[i, 1].repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)  # [b, heads, L, d]
        x = x + attn.transpose(1, 2).reshape(b * longest, -1) @ params[p + "self_attn.o_proj.weight"].T
        x = x + _mlp(params, i, _rms(x, params[p + "post_attention_layernorm.weight"], shape.rms_eps))
    for j, ids in enumerate(prompts):
        kvs[j][:, :, :, : len(ids)] = written[:, :, j, :, : len(ids)]
    lasts = torch.tensor([j * longest + len(ids) - 1 for j, ids in enumerate(prompts)], device=device)
    last = _rms(x[lasts], params["model.norm.weight"], shape.rms_eps)
    return (last @ _lm_head(params, shape).T).to(torch.float32)


def _decode_step(
    params: dict[str, Any], shape: ModelShape, tokens: Sequence[int], kvs: Sequence[Any], positions: Sequence[int]
) -> Any:
    """One step for a batch: sequence ``b`` feeds ``tokens[b]`` at ``positions[b]`` (its length so
    far) into ``kvs[b]``. Everything runs batched, attention too: the sequences' K/V so far (each
    its own tensor, lengths differ) are packed side by side once per step, for all layers; per
    layer the batch's new K/V go after them, and one attention call covers the whole batch, each
    query masked to its own sequence's segment and its own new column. One query position per
    sequence, so the query heads sharing a K/V head are laid out as that head's query rows (no
    repeated K/V). The new K/V are written into each sequence's tensor once per step, for all
    layers at once. Returns float32 logits ``[batch, vocab]``."""
    device = kvs[0].device
    group = shape.heads // shape.kv_heads
    b = len(tokens)
    pos = torch.tensor(list(positions), device=device, dtype=torch.long)
    x = params["model.embed_tokens.weight"][torch.tensor(list(tokens), device=device, dtype=torch.long)]
    rope = rope_tables(pos, shape, x.dtype)
    bounds = list(
        itertools.accumulate((int(at) for at in positions), initial=0)
    )  # old tokens of j: [bounds[j], bounds[j+1])
    old = bounds[-1]
    packed = torch.cat([kvs[j][:, :, :, : positions[j]] for j in range(b)], dim=3)  # [layers, 2, kv_heads, old, d]
    cols = torch.arange(old + b, device=device)
    starts = torch.tensor(bounds[:-1], device=device, dtype=torch.long)[:, None]
    ends = torch.tensor(bounds[1:], device=device, dtype=torch.long)[:, None]
    own = torch.arange(b, device=device)[:, None] + old
    seen = ((cols[None, :] >= starts) & (cols[None, :] < ends)) | (cols[None, :] == own)  # [batch, old + batch]
    mask = seen.repeat_interleave(group, dim=0)[None, None]  # rows (sequence, query head of the group)
    new_kv = []
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        h = _rms(x, params[p + "input_layernorm.weight"], shape.rms_eps)
        q, k, v = _qkv(params, i, h, rope, shape)
        new_kv.append(torch.stack((k, v)))  # [2, batch, kv_heads, head_dim]
        keys = torch.cat((packed[i, 0], k.transpose(0, 1)), dim=1)
        values = torch.cat((packed[i, 1], v.transpose(0, 1)), dim=1)
        queries = (
            q.view(b, shape.kv_heads, group, shape.head_dim)
            .permute(1, 0, 2, 3)
            .reshape(shape.kv_heads, b * group, shape.head_dim)
        )
        attn = F.scaled_dot_product_attention(queries[None], keys[None], values[None], attn_mask=mask)[0]
        attn = attn.view(shape.kv_heads, b, group, shape.head_dim).permute(1, 0, 2, 3).reshape(b, -1)
        x = x + attn @ params[p + "self_attn.o_proj.weight"].T
        x = x + _mlp(params, i, _rms(x, params[p + "post_attention_layernorm.weight"], shape.rms_eps))
    written = torch.stack(new_kv)  # [layers, 2, batch, kv_heads, head_dim]
    for j in range(b):
        kvs[j][:, :, :, positions[j]] = written[:, :, j]
    last = _rms(x, params["model.norm.weight"], shape.rms_eps)
    return (last @ _lm_head(params, shape).T).to(torch.float32)


def prefill(params: dict[str, Any], shape: ModelShape, ids: Sequence[int], kv: Any, start: int) -> Any:
    """See :func:`_prefill` (run without autograd)."""
    with torch.inference_mode():
        return _prefill(params, shape, ids, kv, start)


def prefill_batch(
    params: dict[str, Any], shape: ModelShape, prompts: Sequence[Sequence[int]], kvs: Sequence[Any]
) -> Any:
    """See :func:`_prefill_batch` (run without autograd)."""
    with torch.inference_mode():
        return _prefill_batch(params, shape, prompts, kvs)


def decode_step(
    params: dict[str, Any], shape: ModelShape, tokens: Sequence[int], kvs: Sequence[Any], positions: Sequence[int]
) -> Any:
    """See :func:`_decode_step` (run without autograd)."""
    with torch.inference_mode():
        return _decode_step(params, shape, tokens, kvs, positions)


def pick_device(name: str | None) -> Any:
    if name:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
