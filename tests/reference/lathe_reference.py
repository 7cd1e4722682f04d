#!/usr/bin/env python3
"""Independent numerical reference for Lathe's training semantics (docs/training.md).

Plain eager PyTorch, written the way a user would fine-tune a model by hand ("the seed
recipe"): hand-written LoRA layers on plain nn.Modules, a Hugging Face style
Llama/Mistral/Qwen2 decoder, torch.optim.AdamW or SGD (or the 8-bit AdamW and Adafactor
written out here), or MeZO's zeroth-order step (method: mezo, over LoRA or every weight);
QLoRA (method: qlora) is LoRA over projections whose frozen weights are replaced by their
NF4 (4-bit NormalFloat, double-quantized) round trip, written out here.
It reads the same job spec, model directory, data file and PEFT adapters as `lathe-worker`,
and reports the same step events, so that tests can hold the C++ engine to it within 1e-4.

Run with the project venv's Python (.venv/bin/python: torch 2.11, numpy, PyYAML; made by
scripts/install-deps). Nothing here imports transformers, peft or safetensors.

  lathe_reference.py train --spec job.yaml [--output json] [--threads N]
                           [--dtype float32|float64] [--adapter-out DIR] [--model-out DIR]
                           [--products widen|bf16|autocast]
  lathe_reference.py score --model DIR [--adapter DIR [--lora-alpha A] [--use-rslora]]
                           --data FILE --seq-len N [--logits-out FILE.safetensors]
                           [--output json] [--dtype float32|float64]
  lathe_reference.py optimizer-replay --in IN.safetensors --out OUT.safetensors
  lathe_reference.py nf4-quantize --in IN.safetensors --out OUT.safetensors

As a module: train(spec, ...), score(model_dir, adapter_dir, data_file, seq_len),
optimizer_replay(in_path, out_path), nf4_quantize(w), nf4_dequantize(q, shape),
nf4_quantize_file(in_path, out_path), lr_at(...), epoch_permutation(...),
read/write_safetensors(...).
"""

import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
IGNORE = -100
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
AUTO_MICRO_BATCH_TOKENS = 8192
OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "sgd")
METHODS = ("lora", "qlora", "full", "mezo")
MEZO_TRAINABLE = ("lora", "full")


class ReferenceError(Exception):
    """A one-line user error (bad spec, model, data)."""


# --------------------------------------------------------------------------------------
# safetensors (read and write by hand: 8-byte LE header length, JSON header, raw LE data)

_NP_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64,
              "I32": np.int32, "U8": np.uint8, "BF16": np.uint16}


def read_safetensors(path):
    """Returns ({name: torch tensor}, metadata). BF16/F16 become float32; F32, F64, I64, I32
    and U8 keep their type."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ReferenceError(f"{path}: not a safetensors file (too short)")
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len].decode("utf-8"))
    base = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        dtype = info["dtype"]
        shape = list(info["shape"])
        begin, end = info["data_offsets"]
        if dtype not in _NP_DTYPES:
            raise ReferenceError(f"{path}: {name}: unsupported dtype {dtype}")
        arr = np.frombuffer(raw, dtype=np.dtype(_NP_DTYPES[dtype]).newbyteorder("<"),
                            count=(end - begin) // np.dtype(_NP_DTYPES[dtype]).itemsize,
                            offset=base + begin)
        if dtype == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        elif dtype == "F16":
            arr = arr.astype(np.float32)
        tensors[name] = torch.from_numpy(np.array(arr, copy=True).reshape(shape))
    return tensors, metadata


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} as F32 (float64 tensors are rounded to it) or U8 (uint8)."""
    header = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu()
        if t.dtype == torch.float64:
            t = t.to(torch.float32)
        if t.dtype == torch.float32:
            dtype, data = "F32", t.contiguous().numpy().astype("<f4").tobytes()
        elif t.dtype == torch.uint8:
            dtype, data = "U8", t.contiguous().numpy().tobytes()
        else:
            raise ValueError(f"{name}: only float32 and uint8 are written, got {t.dtype}")
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------
# Model config and weights


def load_model_config(model_dir):
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise ReferenceError(f"{path}: {e.strerror}")
    mt = raw.get("model_type")
    if mt not in ("llama", "mistral", "qwen2"):
        raise ReferenceError(f"{path}: model_type: unsupported {mt!r}")
    if raw.get("hidden_act", "silu") not in ("silu", None):
        raise ReferenceError(f"{path}: hidden_act: only silu")
    c = {"model_type": mt}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings"):
        if raw.get(key) is None:
            raise ReferenceError(f"{path}: {key}: required field is missing")
        c[key] = int(raw[key])
    c["num_key_value_heads"] = int(raw.get("num_key_value_heads") or c["num_attention_heads"])
    c["head_dim"] = int(raw.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    c["rms_norm_eps"] = float(raw.get("rms_norm_eps") if raw.get("rms_norm_eps") is not None
                              else 1e-6)
    c["rope_theta"] = float(raw.get("rope_theta") if raw.get("rope_theta") is not None
                            else 10000.0)
    c["rope_scaling"] = raw.get("rope_scaling")
    c["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    if mt == "qwen2":
        c["qkv_bias"], c["o_bias"], c["mlp_bias"] = True, False, False
    elif mt == "llama":
        ab = bool(raw.get("attention_bias", False))
        c["qkv_bias"], c["o_bias"], c["mlp_bias"] = ab, ab, bool(raw.get("mlp_bias", False))
    else:
        c["qkv_bias"], c["o_bias"], c["mlp_bias"] = False, False, False
    # Sliding window per layer, by transformers' rules: Llama never; Mistral whenever
    # sliding_window is set; Qwen2 only with use_sliding_window, on layers
    # >= max_window_layers (default 28). Window = tokens attended, the query included.
    windows = [None] * c["num_hidden_layers"]
    sw = raw.get("sliding_window")
    if sw is not None and mt == "mistral":
        windows = [int(sw)] * c["num_hidden_layers"]
    elif sw is not None and mt == "qwen2" and raw.get("use_sliding_window", False):
        first = raw.get("max_window_layers")
        first = 28 if first is None else int(first)
        windows = [int(sw) if i >= first else None for i in range(c["num_hidden_layers"])]
    c["windows"] = windows
    c["raw"] = raw
    return c


def rope_inv_freq(cfg):
    """inv_freq[i] = theta^(-2i/head_dim), rescaled by rope_scaling; float64."""
    d = cfg["head_dim"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg["rope_scaling"]
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return inv
    factor = float(rs["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(rs["low_freq_factor"])
        high = float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        low_wavelen = old / low
        high_wavelen = old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ReferenceError(f"rope_scaling: unsupported type {kind!r}")


def load_model_weights(model_dir):
    """{HF name: float32 tensor} from model.safetensors or the sharded index."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        return read_safetensors(single)[0]
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        out = {}
        for shard in sorted(set(weight_map.values())):
            tensors, _ = read_safetensors(os.path.join(model_dir, shard))
            out.update(tensors)
        return out
    raise ReferenceError(f"{model_dir}: neither model.safetensors nor "
                         "model.safetensors.index.json")


def module_path(layer, module):
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def peft_name(layer, module, which):
    return f"base_model.model.{module_path(layer, module)}.lora_{which}.weight"


# --------------------------------------------------------------------------------------
# Modules

# How the products with a frozen bfloat16 weight run under precision bf16 (`--products`):
#   widen:    the weight widened to the compute type (float32): the C++ engine's fallback on
#             a CPU without native bfloat16 products (LATHE_CPU_BF16=0);
#   bf16:     float32 products of bfloat16-rounded operands (forward and backward), where
#             the C++ engine multiplies bfloat16 natively: in a LoRA job, every product of a
#             frozen projection, its adapter and attention of at least BF16_MIN_PRODUCT
#             multiply-adds, and the LM head's; float32 accumulation as in the engine;
#   autocast: what a PyTorch user runs, the forward and the loss under
#             torch.autocast("cpu", dtype=torch.bfloat16): a baseline for benchmarks, not a
#             reference of the engine's numerics.
PRODUCTS = ("widen", "bf16", "autocast")
BF16_MIN_PRODUCT = 1 << 18  # kernels/ops/matmul.cc's kMinKernelProduct


def _round_bf16(t):
    return t.bfloat16().float()


class Bf16MatMul(torch.autograd.Function):
    """a b (batched as torch.matmul, no broadcasting) with a, b and in backward the incoming
    gradient rounded to bfloat16, the products in float32 (exact products of bfloat16
    operands, float32 sums)."""

    @staticmethod
    def forward(ctx, a, b):
        a, b = _round_bf16(a), _round_bf16(b)
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        g = _round_bf16(g)
        return (g @ b.transpose(-1, -2) if ctx.needs_input_grad[0] else None,
                a.transpose(-1, -2) @ g if ctx.needs_input_grad[1] else None)


def bf16_job(x, weight, products):
    """Whether a product of float32 x with frozen `weight` (and its adapter) belongs to a
    LoRA bf16 job whose products run as --products bf16 says."""
    return (products == "bf16" and weight.dtype == torch.bfloat16 and x.dtype == torch.float32
            and not weight.requires_grad)


def maybe_bf16_matmul(a, b, bf16, always=False):
    """a b (a: [..., m, k], b: [..., k, n]), rounded as the C++ engine rounds it when `bf16`
    and the product has at least BF16_MIN_PRODUCT multiply-adds per matrix (or `always`)."""
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if bf16 and (always or m * k * n >= BF16_MIN_PRODUCT):
        return Bf16MatMul.apply(a, b)
    return torch.matmul(a, b.to(a.dtype))


def linear(x, weight, bf16, always=False):
    """x W^T for x [..., in], in x's dtype (W converted), with maybe_bf16_matmul's rounding."""
    x2 = x.reshape(-1, x.shape[-1])
    y = maybe_bf16_matmul(x2, weight.t(), bf16, always)
    return y.view(*x.shape[:-1], weight.shape[0])


def frozen_linear(x, weight, bias, products, always=False):
    """x W^T + b, W (and b) frozen unless they require grad, as `products` runs it (PRODUCTS);
    `always`: the bf16 rounding whatever the product's size (the LM head)."""
    if products == "autocast" and torch.is_autocast_cpu_enabled():
        return F.linear(x, weight, bias)
    if bf16_job(x, weight, products):
        y = linear(x, weight, True, always)
        return y + bias.to(y.dtype) if bias is not None else y
    return F.linear(x, weight.to(x.dtype), bias.to(x.dtype) if bias is not None else None)


class LoRALinear(nn.Module):
    """y = x W^T + b + s * dropout(x) A^T B^T; W and b frozen unless `train_base`."""

    def __init__(self, weight, bias, train_base):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=train_base)
        self.bias = nn.Parameter(bias, requires_grad=train_base) if bias is not None else None
        self.lora_A = None
        self.lora_B = None
        self.scaling = 0.0
        self.dropout = 0.0
        self.products = "widen"

    def add_lora(self, a, b, scaling, dropout):
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)
        self.scaling = scaling
        self.dropout = dropout

    def forward(self, x):
        # Frozen weights stored in bf16/fp16 are widened to x's type as they are used
        # (or multiplied as self.products says).
        y = frozen_linear(x, self.weight, self.bias, self.products)
        if self.lora_A is not None:
            xd = F.dropout(x, p=self.dropout, training=True) if self.dropout > 0 else x
            if bf16_job(x, self.weight, self.products):
                y = y + self.scaling * linear(linear(xd, self.lora_A, True), self.lora_B, True)
            else:
                y = y + self.scaling * F.linear(F.linear(xd, self.lora_A), self.lora_B)
        return y


class RMSNorm(nn.Module):
    def __init__(self, weight, eps, train):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=train)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg, w, prefix, train_base, window):
        super().__init__()
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        self.window = window
        self.products = "widen"

        def lin(name, has_bias):
            return LoRALinear(w[f"{prefix}.{name}.weight"],
                              w[f"{prefix}.{name}.bias"] if has_bias else None, train_base)

        self.q_proj = lin("q_proj", cfg["qkv_bias"])
        self.k_proj = lin("k_proj", cfg["qkv_bias"])
        self.v_proj = lin("v_proj", cfg["qkv_bias"])
        self.o_proj = lin("o_proj", cfg["o_bias"])

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        # Query head h reads key/value head h // rep.
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        bf16 = self.products == "bf16" and q.dtype == torch.float32
        scores = maybe_bf16_matmul(q, k.transpose(-1, -2), bf16) / math.sqrt(self.head_dim)
        i = torch.arange(t).view(t, 1)
        j = torch.arange(t).view(1, t)
        allowed = j <= i
        if self.window is not None:
            allowed = allowed & (j > i - self.window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = maybe_bf16_matmul(probs, v, bf16).transpose(1, 2).reshape(
            b, t, self.heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg, w, prefix, train_base):
        super().__init__()

        def lin(name):
            return LoRALinear(w[f"{prefix}.{name}.weight"],
                              w[f"{prefix}.{name}.bias"] if cfg["mlp_bias"] else None,
                              train_base)

        self.gate_proj = lin("gate_proj")
        self.up_proj = lin("up_proj")
        self.down_proj = lin("down_proj")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, w, layer, train_base):
        super().__init__()
        p = f"model.layers.{layer}"
        eps = cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(w[f"{p}.input_layernorm.weight"], eps, train_base)
        self.self_attn = Attention(cfg, w, f"{p}.self_attn", train_base, cfg["windows"][layer])
        self.post_attention_layernorm = RMSNorm(w[f"{p}.post_attention_layernorm.weight"], eps,
                                                train_base)
        self.mlp = MLP(cfg, w, f"{p}.mlp", train_base)

    def forward(self, h, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    def __init__(self, cfg, weights, dtype=torch.float32, train_base=False, storage=None,
                 checkpointing=False):
        """`storage`: the type frozen weights are kept in (bf16/fp16; default `dtype`).
        `checkpointing`: recompute each decoder layer in backward (torch.utils.checkpoint)."""
        super().__init__()
        self.cfg = cfg
        keep = storage if storage is not None and not train_base else dtype
        w = {k: v.to(keep).clone() for k, v in weights.items()}
        v, hdim = cfg["vocab_size"], cfg["hidden_size"]
        if tuple(w["model.embed_tokens.weight"].shape) != (v, hdim):
            raise ReferenceError("model.embed_tokens.weight: shape "
                                 f"{list(w['model.embed_tokens.weight'].shape)} != {[v, hdim]}")
        self.embed_tokens = nn.Parameter(w["model.embed_tokens.weight"],
                                         requires_grad=train_base)
        self.layers = nn.ModuleList([DecoderLayer(cfg, w, i, train_base)
                                     for i in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(w["model.norm.weight"], cfg["rms_norm_eps"], train_base)
        if cfg["tie_word_embeddings"]:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(w["lm_head.weight"], requires_grad=train_base)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.dtype = dtype
        self.checkpointing = checkpointing
        self.products = "widen"

    def set_products(self, products):
        """How products with frozen bfloat16 weights run (PRODUCTS). Attention's products
        are rounded only in a LoRA job (frozen bfloat16 weights), as the C++ engine does."""
        self.products = products
        frozen_bf16 = (self.embed_tokens.dtype == torch.bfloat16
                       and not self.embed_tokens.requires_grad)
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.products = products
            elif isinstance(module, Attention):
                module.products = products if frozen_bf16 else "widen"

    def projection(self, layer, module):
        blk = self.layers[layer]
        owner = blk.self_attn if module in ATTENTION_MODULES else blk.mlp
        return getattr(owner, module)

    def head_weight(self):
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(self, ids):
        return self.head(self.hidden(ids))

    def head(self, hidden):
        return frozen_linear(hidden, self.head_weight(), None, self.products, always=True)

    def hidden(self, ids):
        """Final-normalised hidden states."""
        t = ids.shape[1]
        pos = torch.arange(t, dtype=torch.float64)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(self.dtype)
        sin = emb.sin().to(self.dtype)
        h = F.embedding(ids, self.embed_tokens).to(self.dtype)
        for layer in self.layers:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        return self.norm(h)

    def named_trainable(self):
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def hf_params(self):
        """{Hugging Face name: parameter} of every base weight (a tied head is the
        embeddings, under their name only)."""
        out = {"model.embed_tokens.weight": self.embed_tokens,
               "model.norm.weight": self.norm.weight}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head
        for i, blk in enumerate(self.layers):
            p = f"model.layers.{i}"
            out[f"{p}.input_layernorm.weight"] = blk.input_layernorm.weight
            out[f"{p}.post_attention_layernorm.weight"] = blk.post_attention_layernorm.weight
            for m in LORA_TARGETS:
                lin = self.projection(i, m)
                out[f"{module_path(i, m)}.weight"] = lin.weight
                if lin.bias is not None:
                    out[f"{module_path(i, m)}.bias"] = lin.bias
        return out

    def hf_state(self):
        """Full weights under Hugging Face names (for method: full output)."""
        return {n: p.detach() for n, p in self.hf_params().items()}

    def adapter_params(self, targets):
        """{PEFT adapter name: LoRA parameter} of `targets` (the names write_adapter writes)."""
        out = {}
        for layer in range(self.cfg["num_hidden_layers"]):
            for m in LORA_TARGETS:
                if m in targets:
                    lin = self.projection(layer, m)
                    out[peft_name(layer, m, "A")] = lin.lora_A
                    out[peft_name(layer, m, "B")] = lin.lora_B
        return out


def lora_scaling(alpha, rank, use_rslora):
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def attach_lora(model, rank, alpha, use_rslora, targets, dropout, seed=0, init_from=None,
                dtype=torch.float32):
    """Adds LoRA to `targets` of every layer. A ~ U(-1/sqrt(in), 1/sqrt(in)) from a
    torch.Generator seeded with `seed`, drawn layer by layer and, within a layer, in model
    order (q, k, v, o, gate, up, down); B = 0. Or both from the PEFT adapter `init_from`."""
    s = lora_scaling(alpha, rank, use_rslora)
    loaded = None
    if init_from:
        loaded = load_adapter_tensors(init_from)
    gen = torch.Generator().manual_seed(int(seed))
    for layer in range(model.cfg["num_hidden_layers"]):
        for m in LORA_TARGETS:
            if m not in targets:
                continue
            lin = model.projection(layer, m)
            out_f, in_f = lin.weight.shape
            if loaded is not None:
                na, nb = peft_name(layer, m, "A"), peft_name(layer, m, "B")
                if na not in loaded or nb not in loaded:
                    raise ReferenceError(f"lora.init_from: {init_from}: missing {na} or {nb}")
                a, b = loaded[na], loaded[nb]
                if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
                    raise ReferenceError(
                        f"lora.init_from: {na}: shapes {list(a.shape)}/{list(b.shape)} do not "
                        f"match rank {rank} and [{out_f}, {in_f}]")
                a, b = a.to(dtype).clone(), b.to(dtype).clone()
            else:
                bound = 1.0 / math.sqrt(in_f)
                a = torch.empty(rank, in_f, dtype=torch.float32).uniform_(-bound, bound,
                                                                           generator=gen)
                a = a.to(dtype)
                b = torch.zeros(out_f, rank, dtype=dtype)
            lin.add_lora(a, b, s, dropout)


def load_adapter_tensors(adapter_dir):
    path = os.path.join(adapter_dir, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise ReferenceError(f"{adapter_dir}: no adapter_model.safetensors")
    return read_safetensors(path)[0]


def load_adapter_config(adapter_dir):
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        c = json.load(f)
    targets = c.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    return {"r": int(c.get("r", 8)), "lora_alpha": float(c.get("lora_alpha", 8)),
            "use_rslora": bool(c.get("use_rslora", False)),
            "lora_dropout": float(c.get("lora_dropout", 0.0) or 0.0),
            "target_modules": list(targets or [])}


def write_adapter(model, out_dir, rank, alpha, use_rslora, targets, dropout, base_path):
    os.makedirs(out_dir, exist_ok=True)
    tensors = {n: p.detach() for n, p in model.adapter_params(targets).items()}
    write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), tensors,
                      {"format": "pt"})
    config = {"base_model_name_or_path": base_path, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True,
              "lora_alpha": alpha, "lora_dropout": dropout, "peft_type": "LORA", "r": rank,
              "target_modules": [m for m in LORA_TARGETS if m in targets],
              "task_type": "CAUSAL_LM", "use_rslora": use_rslora}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def write_model(model, out_dir, source_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(source_dir, "config.json")) as f:
        config = json.load(f)
    config["torch_dtype"] = "float32"
    write_safetensors(os.path.join(out_dir, "model.safetensors"), model.hf_state(),
                      {"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------------------
# Data


def read_records(path, vocab_size, what="data.train"):
    """[(input_ids list, labels list)] (labels = input_ids when absent)."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise ReferenceError(f"{what}: {path}: {e.strerror}")
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{what}: {path}: line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReferenceError(f"{where}: not JSON ({e.msg})")
        if not isinstance(obj, dict) or "input_ids" not in obj:
            raise ReferenceError(f"{where}: no input_ids")
        ids = obj["input_ids"]
        if (not isinstance(ids, list) or not ids
                or any(not isinstance(x, int) or isinstance(x, bool) for x in ids)):
            raise ReferenceError(f"{where}: input_ids must be a non-empty array of integers")
        for x in ids:
            if x < 0 or x >= vocab_size:
                raise ReferenceError(f"{where}: token id {x} outside [0, {vocab_size}) "
                                     f"(vocab_size {vocab_size})")
        labels = obj.get("labels")
        if labels is None:
            labels = list(ids)
        else:
            if not isinstance(labels, list) or len(labels) != len(ids):
                raise ReferenceError(f"{where}: labels of length "
                                     f"{len(labels) if isinstance(labels, list) else '?'} "
                                     f"!= input_ids {len(ids)}")
            for x in labels:
                if not isinstance(x, int) or isinstance(x, bool) or (
                        x != IGNORE and (x < 0 or x >= vocab_size)):
                    raise ReferenceError(f"{where}: label {x} is neither -100 nor a token id "
                                         f"in [0, {vocab_size})")
        records.append((list(ids), list(labels)))
    if not records:
        raise ReferenceError(f"{what}: {path}: no records")
    return records


def splitmix64(state):
    """Returns (new_state, output)."""
    state = (state + GOLDEN) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def epoch_permutation(n, seed, epoch):
    state = (int(seed) + GOLDEN * (epoch + 1)) & MASK64
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        state, r = splitmix64(state)
        j = r % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def sequences(records, seq_len, pack, seed):
    """Endless iterator of (ids, labels) sequences in training order."""
    epoch = 0
    if pack:
        buf_ids, buf_labels = [], []
        while True:
            for d in epoch_permutation(len(records), seed, epoch):
                ids, labels = records[d]
                buf_ids.extend(ids)
                buf_labels.append(IGNORE)
                buf_labels.extend(labels[1:])
                while len(buf_ids) >= seq_len:
                    yield buf_ids[:seq_len], buf_labels[:seq_len]
                    del buf_ids[:seq_len]
                    del buf_labels[:seq_len]
            epoch += 1
    else:
        while True:
            for d in epoch_permutation(len(records), seed, epoch):
                ids, labels = records[d]
                yield ids[:seq_len], labels[:seq_len]
            epoch += 1


def count_targets(labels):
    """Targets of one sequence: positions t >= 1 whose label is not -100."""
    return sum(1 for x in labels[1:] if x != IGNORE)


def collate(batch):
    """Right-pads to the longest sequence with token 0 and label -100."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        labels[i, :len(y)] = torch.tensor(y, dtype=torch.long)
    return ids, labels


def loss_sum(logits, labels):
    """Summed cross-entropy of position t's logits against labels[t + 1]."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1, :].reshape(-1, v), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


# --------------------------------------------------------------------------------------
# Schedule


def lr_at(k, n, lr, warmup, kind):
    """Learning rate of 0-based step k of n (transformers' get_*_schedule_with_warmup)."""
    if k < warmup:
        return lr * k / warmup
    if kind == "constant":
        return lr
    p = (k - warmup) / max(1, n - warmup)
    if kind == "cosine":
        return lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * p)))
    if kind == "linear":
        return lr * max(0.0, (n - k) / max(1, n - warmup))
    raise ReferenceError(f"train.schedule.kind: unknown {kind!r}")


# --------------------------------------------------------------------------------------
# Job spec


def _load_yaml(text, source):
    try:
        import yaml
    except ImportError:  # JSON specs still work without PyYAML
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ReferenceError(f"{source}: YAML spec needs PyYAML (scripts/install-deps "
                                 "puts it in .venv)")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ReferenceError(f"{source}: malformed YAML: {str(e).splitlines()[0]}")


def load_spec(path_or_dict):
    """Job spec with common/job_spec.h defaults filled in, as nested dicts."""
    if isinstance(path_or_dict, dict):
        raw, source = path_or_dict, "<spec>"
    else:
        source = path_or_dict
        try:
            with open(path_or_dict) as f:
                raw = _load_yaml(f.read(), source)
        except OSError as e:
            raise ReferenceError(f"{source}: {e.strerror}")
    if not isinstance(raw, dict):
        raise ReferenceError(f"{source}: expected a mapping")

    def sect(name):
        v = raw.get(name) or {}
        if not isinstance(v, dict):
            raise ReferenceError(f"{source}: {name}: expected a mapping")
        return v

    model, data, lora, train = sect("model"), sect("data"), sect("lora"), sect("train")
    sched = train.get("schedule") or {}
    spec = {
        "name": raw.get("name"),
        "model": {"path": model.get("path")},
        "data": {"train": data.get("train"), "eval": data.get("eval"),
                 "seq_len": int(data.get("seq_len", 1024)), "pack": bool(data.get("pack", True))},
        "method": raw.get("method", "lora"),
        "mezo": mezo_fields(raw, source),
        "lora": {"rank": int(lora.get("rank", 16)), "alpha": float(lora.get("alpha", 32.0)),
                 "dropout": float(lora.get("dropout", 0.0)),
                 "targets": list(lora.get("targets", LORA_TARGETS)),
                 "use_rslora": bool(lora.get("use_rslora", False)),
                 "init_from": lora.get("init_from") or ""},
        "train": {
            "steps": int(train.get("steps", 0) or 0),
            "epochs": train.get("epochs", 0) or 0,
            "global_batch": int(train.get("global_batch", 8)),
            "micro_batch": train.get("micro_batch", "auto"),
            "lr": float(train.get("lr", 2.0e-4)),
            "schedule": {"kind": sched.get("kind", "cosine"),
                         "warmup_steps": int(sched.get("warmup_steps", 0))},
            **optimizer_fields(train, source),
            "max_grad_norm": float(train.get("max_grad_norm", 1.0)),
            "precision": train.get("precision", "fp32"),
            "seed": int(train.get("seed", 0)),
            "max_nonfinite_steps": int(train.get("max_nonfinite_steps", 10)),
        },
        "strategy": raw.get("strategy", "auto"),
        "output": raw.get("output"),
    }
    t = spec["train"]
    if not spec["model"]["path"]:
        raise ReferenceError(f"{source}: model.path: required field is missing")
    if not spec["data"]["train"]:
        raise ReferenceError(f"{source}: data.train: required field is missing")
    if spec["method"] not in METHODS:
        raise ReferenceError(f"{source}: method: the reference implements "
                             f"{', '.join(METHODS)}, not {spec['method']!r}")
    if t["precision"] not in STORAGE:
        raise ReferenceError(f"{source}: train.precision: unknown {t['precision']!r}")
    if spec["method"] == "mezo":
        if t["optimizer"] != "adamw":
            raise ReferenceError(f"{source}: train.optimizer: {t['optimizer']}: method mezo has "
                                 "its own update (leave train.optimizer out)")
        if train.get("paged_optimizer", False):
            raise ReferenceError(f"{source}: train.paged_optimizer: method mezo keeps no "
                                 "optimizer state")
        if t["precision"] == "fp16":
            raise ReferenceError(f"{source}: train.precision: fp16 does not go with method mezo "
                                 "(no loss scaling without a backward pass): use fp32 or bf16")
    if (t["steps"] > 0) == (float(t["epochs"]) > 0):
        raise ReferenceError(f"{source}: train: exactly one of steps and epochs must be > 0")
    if spec["data"]["seq_len"] < 2:
        raise ReferenceError(f"{source}: data.seq_len: must be >= 2")
    if t["schedule"]["kind"] not in ("cosine", "linear", "constant"):
        raise ReferenceError(f"{source}: train.schedule.kind: unknown {t['schedule']['kind']!r}")
    for m in spec["lora"]["targets"]:
        if m not in LORA_TARGETS:
            raise ReferenceError(f"{source}: lora.targets: unknown module {m!r}")
    mb = t["micro_batch"]
    if mb in (None, "auto", 0):
        t["micro_batch"] = auto_micro_batch(t["global_batch"], spec["data"]["seq_len"])
    else:
        t["micro_batch"] = int(mb)
    if t["global_batch"] % t["micro_batch"] != 0:
        raise ReferenceError(f"{source}: train.global_batch {t['global_batch']} is not "
                             f"divisible by micro_batch {t['micro_batch']}")
    return spec


def mezo_fields(raw, source):
    """The `mezo` mapping of a spec, defaults filled in, validated: {"trainable", "eps"} with
    method mezo, None otherwise (where the mapping must be absent)."""
    method = raw.get("method", "lora")
    if "mezo" in raw and method != "mezo":
        raise ReferenceError(f"{source}: mezo: is for method: mezo only")
    if method != "mezo":
        return None
    m = raw.get("mezo")
    m = {} if m is None else m
    if not isinstance(m, dict):
        raise ReferenceError(f"{source}: mezo: expected a mapping")
    for key in m:
        if key not in ("trainable", "eps"):
            raise ReferenceError(f"{source}: mezo.{key}: unknown field")
    trainable = m.get("trainable", "lora")
    if trainable not in MEZO_TRAINABLE:
        raise ReferenceError(f"{source}: mezo.trainable: must be lora or full, got {trainable!r}")
    eps = m.get("eps", 1.0e-3)
    try:
        if isinstance(eps, bool):
            raise TypeError
        eps = float(eps)
    except (TypeError, ValueError):
        raise ReferenceError(f"{source}: mezo.eps: expected a number, got {eps!r}")
    if not (math.isfinite(eps) and eps > 0):
        raise ReferenceError(f"{source}: mezo.eps: must be > 0 and finite, got {eps!r}")
    return {"trainable": trainable, "eps": eps}


def trains_lora(spec):
    """LoRA adapters are trained: method lora or qlora, or mezo over lora."""
    return spec["method"] in ("lora", "qlora") or (spec["method"] == "mezo"
                                                   and spec["mezo"]["trainable"] == "lora")


def trains_full(spec):
    """Every base weight is trained: method full, or mezo over full."""
    return spec["method"] == "full" or (spec["method"] == "mezo"
                                        and spec["mezo"]["trainable"] == "full")


def optimizer_fields(train, source):
    """The optimizer's fields of a `train` mapping, defaults filled in, validated."""
    o = {"optimizer": train.get("optimizer", "adamw"),
         "adam_beta1": float(train.get("adam_beta1", 0.9)),
         "adam_beta2": float(train.get("adam_beta2", 0.999)),
         "adam_eps": float(train.get("adam_eps", 1e-8)),
         "weight_decay": float(train.get("weight_decay", 0.0)),
         "sgd_momentum": float(train.get("sgd_momentum", 0.0)),
         "sgd_nesterov": train.get("sgd_nesterov", False),
         "adafactor_beta1": float(train.get("adafactor_beta1", 0.0)),
         "adafactor_decay_rate": float(train.get("adafactor_decay_rate", -0.8)),
         "adafactor_clip_threshold": float(train.get("adafactor_clip_threshold", 1.0)),
         "adafactor_relative_step": train.get("adafactor_relative_step", False)}
    if o["optimizer"] not in OPTIMIZERS:
        raise ReferenceError(f"{source}: train.optimizer: unknown {o['optimizer']!r} "
                             f"(one of {', '.join(OPTIMIZERS)})")
    for key in ("sgd_nesterov", "adafactor_relative_step"):
        if not isinstance(o[key], bool):
            raise ReferenceError(f"{source}: train.{key}: expected true or false")
    for key, low, high in (("sgd_momentum", 0.0, 1.0), ("adafactor_beta1", 0.0, 1.0),
                           ("adafactor_decay_rate", -1.0, 0.0)):
        if not low <= o[key] < high:
            raise ReferenceError(f"{source}: train.{key}: must be in [{low:g}, {high:g}), "
                                 f"got {o[key]!r}")
    if o["sgd_nesterov"] and o["sgd_momentum"] == 0:
        raise ReferenceError(f"{source}: train.sgd_nesterov: needs train.sgd_momentum > 0")
    if not o["adafactor_clip_threshold"] > 0:
        raise ReferenceError(f"{source}: train.adafactor_clip_threshold: must be > 0, "
                             f"got {o['adafactor_clip_threshold']!r}")
    return o


def auto_micro_batch(global_batch, seq_len):
    best = 1
    for d in range(1, global_batch + 1):
        if global_batch % d == 0 and d * seq_len <= AUTO_MICRO_BATCH_TOKENS:
            best = d
    return best


def count_steps(spec, records):
    t = spec["train"]
    if t["steps"] > 0:
        return t["steps"]
    if spec["data"]["pack"]:
        per_epoch = sum(len(ids) for ids, _ in records) // spec["data"]["seq_len"]
    else:
        per_epoch = len(records)
    return max(1, int(math.floor(float(t["epochs"]) * per_epoch / t["global_batch"])))


# --------------------------------------------------------------------------------------
# Optimizers: adamw and sgd are torch.optim's; adamw8bit and adafactor are written out
# here from their definitions in docs/training.md. Every in-place op below is the one the
# C++ engine uses, in the same order (lathe-optimizer-replay is held to it bitwise for
# adamw8bit): do not fuse or reorder them.

QUANT_MIN_NUMEL = 4096  # adamw8bit: smaller tensors keep float32 moments
QUANT_BLOCK = 2048


def dynamic_code_map(signed):
    """adamw8bit's dynamic map: 256 sorted float32 codes (0 and 1 among them; negative ones
    only if `signed`) and the 255 float32 midpoints between neighbours."""
    values = []
    for i in range(7):
        f = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        b = [0.1 + 0.9 * j / (f - 1) for j in range(f)]
        scale = 10.0 ** (i - 6)
        for j in range(f - 1):
            mean = (b[j] + b[j + 1]) / 2
            values.append(scale * mean)
            if signed:
                values.append(-scale * mean)
    values += [0.0, 1.0]
    code = torch.tensor(sorted(values), dtype=torch.float64).to(torch.float32)
    assert code.numel() == 256
    return code, (code[:-1] + code[1:]) / 2


CODE_SIGNED, MIDS_SIGNED = dynamic_code_map(True)  # first moment
CODE_UNSIGNED, MIDS_UNSIGNED = dynamic_code_map(False)  # second moment


def dequantize(code, codes, absmax):
    """Flat [P] values code[codes] * absmax of their block of QUANT_BLOCK."""
    return code.index_select(0, codes.long()).view(-1, QUANT_BLOCK).mul_(
        absmax.unsqueeze(1)).view(-1)


def quantize(mids, x):
    """(codes uint8 [P], absmax [B]) of a flat [P] `x`: per block the nearest code of
    x / absmax (an all-zero block divides by 1; a value on a midpoint takes the lower code)."""
    absmax = x.view(-1, QUANT_BLOCK).abs().amax(1)
    safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    codes = torch.searchsorted(mids, x.view(-1, QUANT_BLOCK).div(safe.unsqueeze(1)).view(-1))
    return codes.to(torch.uint8), absmax


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose moments are kept block-wise in 8 bits (state `exp_avg.codes`,
    `exp_avg.absmax`, `exp_avg_sq.codes`, `exp_avg_sq.absmax`) for tensors of at least
    QUANT_MIN_NUMEL elements, and smaller tensors and those of `float32_params` (the token
    embeddings, keeps_float32_moments) exactly as torch.optim.AdamW."""

    def __init__(self, params, lr, betas, eps, weight_decay, float32_params=()):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self._float32 = {id(p) for p in float32_params}

    def _quantized(self, p):
        return p.numel() >= QUANT_MIN_NUMEL and id(p) not in self._float32

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state, n = p.grad, self.state[p], p.numel()
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                t = state["step"]
                bc1 = 1 - b1 ** t
                bc2_sqrt = math.sqrt(1 - b2 ** t)
                step_size = lr / bc1
                if not self._quantized(p):
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                    p.mul_(1 - lr * wd)
                    m.lerp_(g, 1 - b1)  # torch.optim.AdamW's single-tensor step (torch 2.x)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    denom = (v.sqrt() / bc2_sqrt).add_(eps)
                    p.addcdiv_(m, denom, value=-step_size)
                    continue
                # (A float64 run widens the maps; float32 ones are used as they are.)
                code_s, code_u = CODE_SIGNED.to(g.dtype), CODE_UNSIGNED.to(g.dtype)
                gp = g.new_zeros(state["exp_avg.codes"].numel())
                gp[:n] = g.reshape(-1)
                m = dequantize(code_s, state["exp_avg.codes"], state["exp_avg.absmax"])
                v = dequantize(code_u, state["exp_avg_sq.codes"], state["exp_avg_sq.absmax"])
                if wd != 0:
                    p.mul_(1 - lr * wd)
                m.mul_(b1).add_(gp, alpha=1 - b1)
                v.mul_(b2).addcmul_(gp, gp, value=1 - b2)
                denom = (v[:n].sqrt() / bc2_sqrt).add_(eps)
                p.view(-1).addcdiv_(m[:n], denom, value=-step_size)
                state["exp_avg.codes"], state["exp_avg.absmax"] = quantize(
                    MIDS_SIGNED.to(g.dtype), m)
                state["exp_avg_sq.codes"], state["exp_avg_sq.absmax"] = quantize(
                    MIDS_UNSIGNED.to(g.dtype), v)

    def _init_state(self, p, state):
        """Zero moments: float32 ones, or every code the map's 0 and absmax 0."""
        state["step"] = 0
        if not self._quantized(p):
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            return
        blocks = -(-p.numel() // QUANT_BLOCK)
        for key, code in (("exp_avg", CODE_SIGNED), ("exp_avg_sq", CODE_UNSIGNED)):
            zero = int((code == 0).nonzero())
            state[key + ".codes"] = torch.full((blocks * QUANT_BLOCK,), zero, dtype=torch.uint8)
            state[key + ".absmax"] = p.new_zeros(blocks)


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018) with a fixed learning rate: second moment factored
    over the last two dims (state `exp_avg_sq_row`, `exp_avg_sq_col`) or not (`exp_avg_sq`)
    with beta2 = 1 - t^decay_rate, update RMS clipped to clip_threshold, optional first
    moment (`exp_avg`, when beta1 > 0), decoupled weight decay. With relative_step the
    step size replaces lr: max(1e-3, RMS(p)) * min(1e-2, 1 / sqrt(t)), p before the step."""

    def __init__(self, params, lr, beta1, decay_rate, clip_threshold, weight_decay,
                 relative_step=False):
        super().__init__(params, {"lr": lr, "beta1": beta1, "decay_rate": decay_rate,
                                  "clip_threshold": clip_threshold,
                                  "weight_decay": weight_decay,
                                  "relative_step": relative_step})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd, beta1 = group["lr"], group["weight_decay"], group["beta1"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if not state:
                    state["step"] = 0
                    if g.dim() >= 2:
                        state["exp_avg_sq_row"] = g.new_zeros(g.shape[:-1])
                        state["exp_avg_sq_col"] = g.new_zeros(g.shape[:-2] + g.shape[-1:])
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(g)
                    if beta1 > 0:
                        state["exp_avg"] = torch.zeros_like(g)
                state["step"] += 1
                if group["relative_step"]:
                    rms_p = torch.linalg.vector_norm(p, 2).div(math.sqrt(p.numel())).item()
                    lr = max(1e-3, rms_p) * min(1e-2, 1.0 / math.sqrt(state["step"]))
                rho = 1.0 - state["step"] ** group["decay_rate"]
                u2 = g.mul(g).add_(1e-30)
                if g.dim() >= 2:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(rho).add_(u2.mean(-1), alpha=1 - rho)
                    col.mul_(rho).add_(u2.mean(-2), alpha=1 - rho)
                    r = row.div(row.mean(-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    c = col.rsqrt().unsqueeze(-2)
                    u = r.mul(c).mul_(g)
                else:
                    v = state["exp_avg_sq"]
                    v.mul_(rho).add_(u2, alpha=1 - rho)
                    u = v.rsqrt().mul_(g)
                rms = torch.linalg.vector_norm(u, 2).div(math.sqrt(u.numel()))
                u.div_(rms.div_(group["clip_threshold"]).clamp_(min=1.0))
                if beta1 > 0:
                    u = state["exp_avg"].mul_(beta1).add_(u, alpha=1 - beta1)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(u, alpha=-lr)


def param_groups(named, weight_decay, no_decay):
    """Param groups of (name, tensor) pairs: `weight_decay`, and none where no_decay(name)."""
    groups = [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": weight_decay},
              {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def keeps_float32_moments(name):
    """adamw8bit keeps float32 moments for the token embeddings whatever their size, as
    bitsandbytes advises: rows of tokens absent from a batch get no gradient, and where such a
    row's second moment was quantized to 0 but not its first, the update would be m / eps."""
    return name.endswith("embed_tokens.weight")


def make_optimizer(groups, t, lr, float32_params=()):
    """The optimizer `t["optimizer"]` (t: optimizer_fields) over param groups;
    `float32_params`: tensors adamw8bit keeps in float32 (keeps_float32_moments)."""
    kind = t["optimizer"]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=t["sgd_momentum"], dampening=0,
                               nesterov=t["sgd_nesterov"], weight_decay=t["weight_decay"],
                               foreach=False)
    if kind == "adafactor":
        return Adafactor(groups, lr, t["adafactor_beta1"], t["adafactor_decay_rate"],
                         t["adafactor_clip_threshold"], t["weight_decay"],
                         t["adafactor_relative_step"])
    betas = (t["adam_beta1"], t["adam_beta2"])
    if kind == "adamw8bit":
        return AdamW8bit(groups, lr, betas, t["adam_eps"], t["weight_decay"], float32_params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=t["adam_eps"],
                             weight_decay=t["weight_decay"], foreach=False)


def optimizer_state(opt, named):
    """{name: tensor} of the optimizer state of (name, param) pairs, as the C++ checkpoint
    names it: `<key>.<name>`, or `<key>.<name>.<part>` for a state key `<key>.<part>`
    (adamw8bit's codes and absmax); step counts and absent buffers left out."""
    out = {}
    for name, p in named:
        for key, value in opt.state[p].items():
            if key != "step" and value is not None:
                kind, _, part = key.partition(".")
                out[f"{kind}.{name}" + (f".{part}" if part else "")] = value
    return out


def optimizer_replay(in_path, out_path):
    """Applies the optimizer steps recorded in `in_path` (tensors `param.<name>` and
    `grad.<k>.<name>`, k = 1..steps; metadata `steps`, `lrs`, `train` and `no_decay`, the
    last two JSON) to the params in name order, on one thread, and writes their final
    `param.<name>` and the optimizer state (optimizer_state) to `out_path`; returns them."""
    torch.set_num_threads(1)
    tensors, meta = read_safetensors(in_path)
    try:
        steps = int(meta["steps"])
        lrs = [float(x) for x in json.loads(meta["lrs"])]
        t = optimizer_fields(json.loads(meta.get("train", "{}")), in_path)
        no_decay = set(json.loads(meta.get("no_decay", "[]")))
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ReferenceError(f"{in_path}: __metadata__: steps, lrs, train or no_decay missing "
                             f"or malformed ({type(e).__name__}: {e})")
    if len(lrs) != steps:
        raise ReferenceError(f"{in_path}: __metadata__: {len(lrs)} lrs for {steps} steps")
    names = sorted(k[len("param."):] for k in tensors if k.startswith("param."))
    if not no_decay <= set(names):
        raise ReferenceError(f"{in_path}: __metadata__: no_decay: no such params "
                             f"{sorted(no_decay - set(names))}")
    named = [(n, nn.Parameter(tensors["param." + n].to(torch.float32).clone())) for n in names]
    opt = make_optimizer(param_groups(named, t["weight_decay"], no_decay.__contains__), t,
                         lrs[0] if lrs else 0.0,
                         [p for n, p in named if keeps_float32_moments(n)])
    for k in range(1, steps + 1):
        for n, p in named:
            g = tensors.get(f"grad.{k}.{n}")
            if g is None or g.shape != p.shape:
                raise ReferenceError(f"{in_path}: grad.{k}.{n}: missing or not shaped "
                                     f"{list(p.shape)}")
            p.grad = g.to(torch.float32)
        for group in opt.param_groups:
            group["lr"] = lrs[k - 1]
        opt.step()
    out = {f"param.{n}": p.detach() for n, p in named}
    out.update(optimizer_state(opt, named))
    write_safetensors(out_path, out, {"steps": str(steps)})
    return out


# --------------------------------------------------------------------------------------
# NF4 with double quantization (method: qlora; Dettmers et al. 2023, "QLoRA: Efficient
# Finetuning of Quantized LLMs"): the frozen weight of each of the seven projections is kept
# as 4-bit NormalFloat codes, one per entry, in blocks of NF4_BLOCK entries with the block's
# absmax; the absmaxes themselves are kept as 8-bit codes of the signed dynamic map (the one
# of adamw8bit's first moment) in blocks of NF4_ABSMAX_BLOCK around their float32 mean. The
# representation (codes, absmax codes, absmax2, offset) is the C++ engine's bit for bit
# (lathe-nf4-quantize is held to nf4_quantize), and so is the dequantized weight: each float32
# op of nf4_dequantize is one rounding, as in the engine; do not fuse or reorder them.

NF4_BLOCK = 64  # entries per absmax
NF4_ABSMAX_BLOCK = 256  # absmaxes per absmax2
NF4_QUANTILE_OFFSET = 0.9677083  # bitsandbytes' create_normal_map(offset)
# The 16 levels as published (bitsandbytes, the QLoRA paper's appendix), float64; computed
# there from float32 linspace points, so nf4_levels_from_quantiles (float64 throughout)
# agrees within ~1e-7.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
              0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
NF4_ZERO_CODE = 7  # the 0.0 level: every code of a block whose absmax is 0
NF4_MIDS = np.array([(a + b) / 2 for a, b in zip(NF4_LEVELS[:-1], NF4_LEVELS[1:])],
                    dtype=np.float64)
NF4_LEVELS_F32 = np.array(NF4_LEVELS, dtype=np.float64).astype(np.float32)
# Level 2: the signed dynamic map (float32 values) and float64 midpoints between them (not
# MIDS_SIGNED, adamw8bit's float32 ones).
NF4_ABSMAX_MAP = CODE_SIGNED.numpy().copy()
NF4_ABSMAX_MIDS = (NF4_ABSMAX_MAP[:-1].astype(np.float64)
                   + NF4_ABSMAX_MAP[1:].astype(np.float64)) / 2
NF4_ABSMAX_ZERO_CODE = int(np.flatnonzero(NF4_ABSMAX_MAP == 0.0)[0])


def nf4_levels_from_quantiles(offset=NF4_QUANTILE_OFFSET):
    """The NF4 levels by the paper's construction, in float64: N(0, 1) quantiles at 8 points
    linspace(offset, 0.5, 9)[:-1] (positive) and 7 points linspace(offset, 0.5, 8)[:-1]
    (negated), and 0; divided by the largest; sorted."""
    f64 = torch.float64
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=f64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=f64)[:-1])
    v = torch.cat([pos, torch.zeros(1, dtype=f64), neg])
    return sorted((v / v.max()).tolist())


def _block_absmax(values, block):
    """float32 [ceil(len / block)]: max |v| over each block of `block` (the last partial)."""
    blocks = -(-values.size // block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:values.size] = np.abs(values)
    return padded.reshape(blocks, block).max(1)


def _block_codes(values, absmax, block, mids, zero_code):
    """uint8 code of each float32 value: the number of float64 `mids` strictly below
    float(v) / float(absmax of its block) (the nearest level, a tie taking the lower code),
    or `zero_code` in a block whose absmax is 0."""
    scale = np.repeat(absmax.astype(np.float64), block)[:values.size]
    zero = scale == 0
    y = values.astype(np.float64) / np.where(zero, 1.0, scale)
    codes = np.searchsorted(mids, y, side="left")
    codes[zero] = zero_code
    return codes.astype(np.uint8)


def nf4_quantize(w):
    """The NF4 representation of a float32 tensor `w` of n entries (flattened row-major), as
    uint8/float32 tensors: `codes` [ceil(n/2)], entry 2i's 4-bit code in the low nibble of
    byte i and entry 2i+1's in the high one (0 past the end); `absmax_codes` [B] (B =
    ceil(n/64)), `absmax2` [ceil(B/256)] and `offset` [1], the double-quantized block
    maxima."""
    if w.dtype != torch.float32:
        raise ReferenceError(f"nf4: float32 weights only, got {w.dtype}")
    x = w.detach().reshape(-1).contiguous().numpy()
    n = x.size
    if n == 0 or not np.isfinite(x).all():
        raise ReferenceError("nf4: weights must be non-empty and finite")
    # Level 1: a 4-bit code per entry, against its block's absmax.
    absmax = _block_absmax(x, NF4_BLOCK)
    codes = _block_codes(x, absmax, NF4_BLOCK, NF4_MIDS, NF4_ZERO_CODE).astype(np.int64)
    if n % 2:
        codes = np.append(codes, 0)
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    # Level 2: the absmaxes less their mean (summed in float64 in index order, divided in
    # float64, rounded to float32; the subtraction in float32), an 8-bit code each.
    total = 0.0
    for c in absmax.tolist():
        total += c
    offset = np.float32(total / absmax.size)
    centred = absmax - offset  # float32
    absmax2 = _block_absmax(centred, NF4_ABSMAX_BLOCK)
    absmax_codes = _block_codes(centred, absmax2, NF4_ABSMAX_BLOCK, NF4_ABSMAX_MIDS,
                                NF4_ABSMAX_ZERO_CODE)
    return {"codes": torch.from_numpy(packed), "absmax_codes": torch.from_numpy(absmax_codes),
            "absmax2": torch.from_numpy(absmax2),
            "offset": torch.from_numpy(np.array([offset], dtype=np.float32))}


def nf4_absmax(q):
    """The dequantized block maxima, float32 [B]: float32(map[q_j] * absmax2 of its block)
    + offset, each op rounded to float32."""
    codes = q["absmax_codes"].numpy().astype(np.int64)
    absmax2 = np.repeat(q["absmax2"].numpy(), NF4_ABSMAX_BLOCK)[:codes.size]
    scaled = NF4_ABSMAX_MAP[codes] * absmax2  # float32 * float32: one rounding
    return scaled + q["offset"].numpy()[0]  # float32 + float32: one rounding


def nf4_dequantize(q, shape):
    """The float32 weight of shape `shape` that nf4_quantize's `q` stands for:
    float32(NF4[code_i] (rounded to float32) * dequantized absmax of its block)."""
    n = math.prod(shape)
    packed = q["codes"].numpy()
    codes = np.empty(2 * packed.size, dtype=np.int64)
    codes[0::2] = packed & 0x0F
    codes[1::2] = packed >> 4
    absmax = np.repeat(nf4_absmax(q), NF4_BLOCK)[:n]
    w = NF4_LEVELS_F32[codes[:n]] * absmax  # float32 * float32: one rounding
    return torch.from_numpy(w.reshape(shape))


def nf4_round_trip(w):
    """w as method qlora computes with it: nf4_dequantize(nf4_quantize(w)), float32."""
    return nf4_dequantize(nf4_quantize(w), tuple(w.shape))


def nf4_quantize_file(in_path, out_path):
    """Quantizes each float32 2-D tensor `<t>` of `in_path` and writes `<t>.codes`,
    `<t>.absmax_codes`, `<t>.absmax2`, `<t>.offset` (nf4_quantize) and `<t>.dequantized`
    (nf4_dequantize, the input's shape) to `out_path`; returns them."""
    tensors, _ = read_safetensors(in_path)
    out = {}
    for name in sorted(tensors):
        w = tensors[name]
        if w.dtype != torch.float32 or w.dim() != 2:
            raise ReferenceError(f"{in_path}: {name}: expected a 2-D float32 tensor, got "
                                 f"{w.dtype} {list(w.shape)}")
        try:
            q = nf4_quantize(w)
        except ReferenceError as e:
            raise ReferenceError(f"{in_path}: {name}: {e}")
        out.update({f"{name}.{part}": t for part, t in q.items()})
        out[f"{name}.dequantized"] = nf4_dequantize(q, tuple(w.shape))
    write_safetensors(out_path, out)
    return out


@torch.no_grad()
def quantize_projections(model, weights):
    """method qlora: every projection's frozen weight (the seven of every layer, whatever
    lora.targets; not their biases) becomes nf4_round_trip of `weights`' (float32) value,
    kept in float32 whatever train.precision (widened in a float64 run)."""
    for layer in range(model.cfg["num_hidden_layers"]):
        for m in LORA_TARGETS:
            lin = model.projection(layer, m)
            w = weights[f"{module_path(layer, m)}.weight"].to(torch.float32)
            lin.weight = nn.Parameter(nf4_round_trip(w).to(model.dtype), requires_grad=False)


# --------------------------------------------------------------------------------------
# MeZO (method: mezo; Malladi et al. 2023, "Fine-Tuning Language Models with Just Forward
# Passes"): a step estimates the gradient's projection on a random direction z from the losses
# at theta + eps z and theta - eps z, and moves theta along z. z is never stored: it is drawn
# again from a generator reseeded with the step's seed. The ops below are the C++ engine's, in
# the same order (the step events are compared step for step): do not fuse or reorder them.


def mezo_seed(seed, step):
    """The perturbation seed of 1-based optimizer step `step`: (train.seed + step *
    0x9E3779B97F4A7C15) mod 2^64. (libtorch's CPU generator, an mt19937, uses only the
    low 32 bits of a seed; those differ from step to step too, the multiplier being odd.)"""
    return (int(seed) + int(step) * GOLDEN) & MASK64


def mezo_params(model, spec):
    """[(exported name, tensor)] of what method mezo trains, ascending by name: the PEFT
    adapter names (as write_adapter writes them) with mezo.trainable lora, the Hugging Face
    weight names (as write_model writes them; a tied head is the embeddings) with full."""
    named = (model.adapter_params(spec["lora"]["targets"]) if trains_lora(spec)
             else model.hf_params())
    return sorted(named.items())


@torch.no_grad()
def mezo_perturb(named, seed, scale):
    """p += scale * z for each (name, p) of `named` in turn, z ~ N(0, 1) drawn in float32 by
    torch.randn from a generator seeded with `seed` (then converted to p's type)."""
    g = torch.Generator()
    g.manual_seed(seed)
    for _, p in named:
        z = torch.randn(p.shape, generator=g, dtype=torch.float32)
        p.add_(z.to(p.dtype), alpha=scale)


@torch.no_grad()
def mezo_loss(model, micro_batches, targets):
    """The step's loss, forward only: summed cross-entropy of each (ids, labels) micro-batch
    (.item() of each, summed in double), divided by the step's `targets`."""
    total = 0.0
    for ids, labels in micro_batches:
        total += loss_sum(model.head(model.hidden(ids)), labels).item()
    return total / targets


def mezo_projected_grad(model, named, seed, eps, micro_batches, targets):
    """(loss_plus, loss_minus, projected): the losses at theta + eps z and theta - eps z and
    (loss_plus - loss_minus) / (2 eps). Perturbs by +eps, -2 eps, +eps: theta is left as it
    was up to rounding."""
    mezo_perturb(named, seed, eps)
    plus = mezo_loss(model, micro_batches, targets)
    mezo_perturb(named, seed, -2 * eps)
    minus = mezo_loss(model, micro_batches, targets)
    mezo_perturb(named, seed, eps)
    return plus, minus, (plus - minus) / (2 * eps)


@torch.no_grad()
def mezo_update(named, seed, projected, lr, weight_decay, no_decay):
    """p -= lr * (projected * z + wd * p), with the z of mezo_perturb(named, seed, .) and
    wd = 0 for the tensors where no_decay(name)."""
    g = torch.Generator()
    g.manual_seed(seed)
    for name, p in named:
        z = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
        d = z.mul_(projected)
        wd = 0.0 if no_decay(name) else weight_decay
        if wd != 0:
            d.add_(p, alpha=wd)
        p.add_(d, alpha=-lr)


# --------------------------------------------------------------------------------------
# Training


def no_decay_full(spec, name):
    """As the Hugging Face Trainer: when every weight is trained, no weight decay on biases
    and norm weights (`name` a parameter's name, Hugging Face's or the module's)."""
    return trains_full(spec) and (name.endswith(".bias") or name.endswith("norm.weight"))


def build_optimizer(model, spec):
    t = spec["train"]

    def no_decay(n):
        return no_decay_full(spec, n)
    float32 = [model.embed_tokens] if model.embed_tokens.requires_grad else []
    return make_optimizer(param_groups(model.named_trainable(), t["weight_decay"], no_decay), t,
                          t["lr"], float32)


STORAGE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(spec, dtype):
    model_dir = spec["model"]["path"]
    cfg = load_model_config(model_dir)
    weights = load_model_weights(model_dir)
    full = trains_full(spec)
    strategy = spec["strategy"]
    checkpointing = isinstance(strategy, dict) and bool(
        strategy.get("activation_checkpointing", False))
    # Low precision keeps the frozen weights in bf16/fp16 and computes in `dtype`
    # (docs/training.md, "Precision": what the C++ trainer does on the CPU).
    storage = STORAGE[spec["train"]["precision"]] if dtype == torch.float32 else None
    model = CausalLM(cfg, weights, dtype=dtype, train_base=full, storage=storage,
                     checkpointing=checkpointing)
    if spec["method"] == "qlora":
        # The projections compute with the NF4 round trip (float32) of their weights in the
        # storage precision (the 16-bit base under bf16/fp16, as the C++ engine loads it);
        # embeddings, norms, biases and the LM head as for method lora.
        quantize_projections(model, {k: v.to(storage).float() for k, v in weights.items()}
                             if storage is not None else weights)
    del weights
    if not full:
        lo = spec["lora"]
        attach_lora(model, lo["rank"], lo["alpha"], lo["use_rslora"], lo["targets"],
                    lo["dropout"], seed=spec["train"]["seed"], init_from=lo["init_from"] or None,
                    dtype=dtype)
    return model


def train(spec, dtype=torch.float32, on_step=None, adapter_out=None, model_out=None,
          products="widen"):
    """Trains per docs/training.md. Returns {"steps": [step events], "done": done event,
    "model": the trained CausalLM}. `spec` is a path or a dict (see load_spec); `products`:
    how products with frozen bfloat16 weights run (PRODUCTS)."""
    spec = load_spec(spec)
    t = spec["train"]
    if products not in PRODUCTS:
        raise ReferenceError(f"--products: {products!r} is not one of {', '.join(PRODUCTS)}")
    if products != "widen" and (t["precision"] != "bf16" or dtype != torch.float32):
        raise ReferenceError(f"--products {products} needs train.precision bf16 and --dtype "
                             "float32")
    if products == "autocast" and spec["method"] == "mezo":
        raise ReferenceError("--products autocast: method mezo has no autocast loop here")
    autocast = products == "autocast"
    torch.manual_seed(t["seed"])  # only dropout draws from the global generator
    model = build_model(spec, dtype)
    model.set_products(products)
    records = read_records(spec["data"]["train"], model.cfg["vocab_size"])
    n_steps = count_steps(spec, records)
    seq_len, G, M = spec["data"]["seq_len"], t["global_batch"], t["micro_batch"]
    if seq_len > model.cfg["max_position_embeddings"]:
        raise ReferenceError(f"data.seq_len {seq_len} exceeds max_position_embeddings "
                             f"{model.cfg['max_position_embeddings']}")
    stream = sequences(records, seq_len, spec["data"]["pack"], t["seed"])
    params = [p for _, p in model.named_trainable()]
    mezo = spec["method"] == "mezo"
    opt = None if mezo else build_optimizer(model, spec)
    mezo_named = mezo_params(model, spec) if mezo else None
    sched = t["schedule"]
    events = []
    total_tokens = 0
    # fp16: dynamic loss scaling (2^16, x0.5 and skip on overflow, x2 after 2000 clean steps).
    scale = 65536.0 if t["precision"] == "fp16" else 1.0
    clean = 0
    bad_in_a_row = 0
    start = time.perf_counter()
    for k in range(n_steps):
        step_start = time.perf_counter()
        batch = [next(stream) for _ in range(G)]
        tokens = sum(len(ids) for ids, _ in batch)
        targets = sum(count_targets(labels) for _, labels in batch)
        lr = lr_at(k, n_steps, t["lr"], sched["warmup_steps"], sched["kind"])
        loss = None
        grad_norm = None
        skipped = False
        phases = {"forward": 0.0, "loss": 0.0, "backward": 0.0, "comm": 0.0, "optimizer": 0.0}
        step_scale = scale
        if targets > 0 and mezo:
            micro_batches = [collate(batch[m * M:(m + 1) * M]) for m in range(G // M)]
            mezo_step_seed = mezo_seed(t["seed"], k + 1)
            t0 = time.perf_counter()
            loss_plus, loss_minus, projected = mezo_projected_grad(
                model, mezo_named, mezo_step_seed, spec["mezo"]["eps"], micro_batches, targets)
            t3 = time.perf_counter()
            phases["forward"] = t3 - t0
            loss = (loss_plus + loss_minus) / 2
            grad_norm = abs(projected)
            skipped = not (math.isfinite(loss_plus) and math.isfinite(loss_minus))
        elif targets > 0:
            for p in params:
                p.grad = None
            total = 0.0
            for m in range(G // M):
                ids, labels = collate(batch[m * M:(m + 1) * M])
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    h = model.hidden(ids)
                    t1 = time.perf_counter()
                    logits = model.head(h)
                    # float32 logits for the loss, as Hugging Face's models do under autocast
                    s = loss_sum(logits.float() if autocast else logits, labels)
                t2 = time.perf_counter()
                (s * (scale / targets)).backward()
                total += s.item()
                t3 = time.perf_counter()
                phases["forward"] += t1 - t0
                phases["loss"] += t2 - t1
                phases["backward"] += t3 - t2
            loss = total / targets
            grads = [p.grad for p in params if p.grad is not None]
            if scale != 1.0:
                for g in grads:
                    g.mul_(1.0 / scale)
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
            grad_norm = norm
            skipped = not (math.isfinite(loss) and math.isfinite(norm))
        if skipped:
            for p in params:
                p.grad = None
            if t["precision"] == "fp16":
                scale = max(1.0, scale / 2)
            clean = 0
            bad_in_a_row += 1
            if bad_in_a_row >= t["max_nonfinite_steps"]:
                raise ReferenceError(f"training step {k + 1}: not finite in {bad_in_a_row} "
                                     "consecutive steps")
        elif targets > 0:
            bad_in_a_row = 0
            if t["precision"] == "fp16":
                clean += 1
                if clean >= 2000:
                    scale, clean = scale * 2, 0
            if mezo:  # no clipping: max_grad_norm is ignored
                mezo_update(mezo_named, mezo_step_seed, projected, lr, t["weight_decay"],
                            lambda n: no_decay_full(spec, n))
                phases["optimizer"] = time.perf_counter() - t3
            else:
                if t["max_grad_norm"] > 0:
                    coef = min(1.0, t["max_grad_norm"] / (norm + 1e-6))
                    if coef < 1.0:
                        for g in grads:
                            g.mul_(coef)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
                phases["optimizer"] = time.perf_counter() - t3
        total_tokens += tokens
        elapsed = time.perf_counter() - step_start
        ev = {"event": "step", "step": k + 1, "steps": n_steps, "loss": loss, "lr": lr,
              "grad_norm": grad_norm, "skipped": skipped, "loss_scale": step_scale,
              "phases": phases,
              "tokens": tokens,
              "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}
        events.append(ev)
        if on_step:
            on_step(ev)
    seconds = time.perf_counter() - start
    final = next((e["loss"] for e in reversed(events)
                  if e["loss"] is not None and not e["skipped"]), None)
    done = {"event": "done", "steps": n_steps, "final_loss": final,
            "tokens_per_s": total_tokens / seconds if seconds > 0 else 0.0, "seconds": seconds,
            "adapter": None, "model": None}
    if adapter_out and trains_lora(spec):
        lo = spec["lora"]
        write_adapter(model, adapter_out, lo["rank"], lo["alpha"], lo["use_rslora"],
                      lo["targets"], lo["dropout"], spec["model"]["path"])
        done["adapter"] = adapter_out
    if model_out and trains_full(spec):
        write_model(model, model_out, spec["model"]["path"])
        done["model"] = model_out
    return {"steps": events, "done": done, "model": model}


# --------------------------------------------------------------------------------------
# Scoring


def score(model_dir, adapter_dir, data_file, seq_len, lora_alpha=None, use_rslora=None,
          dtype=torch.float32):
    """Logits of each record (file order, truncated to seq_len, batch 1) as float32
    [len, vocab] tensors, the mean loss over all targets, and the number of targets."""
    cfg = load_model_config(model_dir)
    model = CausalLM(cfg, load_model_weights(model_dir), dtype=dtype, train_base=False)
    if adapter_dir:
        ac = load_adapter_config(adapter_dir)
        alpha = ac["lora_alpha"] if lora_alpha is None else float(lora_alpha)
        rslora = ac["use_rslora"] if use_rslora is None else bool(use_rslora)
        attach_lora(model, ac["r"], alpha, rslora, ac["target_modules"], 0.0,
                    init_from=adapter_dir, dtype=dtype)
    records = read_records(data_file, cfg["vocab_size"], what="data")
    logits_out = []
    total, targets = 0.0, 0
    with torch.no_grad():
        for ids, labels in records:
            x, y = collate([(ids[:seq_len], labels[:seq_len])])
            logits = model(x)
            total += float(loss_sum(logits.double(), y))
            targets += count_targets(labels[:seq_len])
            logits_out.append(logits[0].to(torch.float32))
    loss = total / targets if targets else None
    return logits_out, loss, targets


# --------------------------------------------------------------------------------------
# CLI


def _fmt(x, spec):
    width = "".join(c for c in spec.split(".")[0] if c.isdigit())
    return ("-" if x is None else format(x, spec)).rjust(int(width) if width else 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("--spec", required=True)
    tr.add_argument("--output", choices=("table", "json"), default="table")
    tr.add_argument("--threads", type=int, default=1)
    tr.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    tr.add_argument("--adapter-out")
    tr.add_argument("--model-out")
    tr.add_argument("--products", choices=PRODUCTS, default="widen")
    sc = sub.add_parser("score")
    sc.add_argument("--model", required=True)
    sc.add_argument("--adapter")
    sc.add_argument("--lora-alpha", type=float)
    sc.add_argument("--use-rslora", action="store_true", default=None)
    sc.add_argument("--data", required=True)
    sc.add_argument("--seq-len", type=int, required=True)
    sc.add_argument("--logits-out")
    sc.add_argument("--output", choices=("table", "json"), default="table")
    sc.add_argument("--threads", type=int, default=1)
    sc.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    rp = sub.add_parser("optimizer-replay")
    rp.add_argument("--in", dest="in_path", required=True)
    rp.add_argument("--out", required=True)
    rp.set_defaults(threads=1, dtype="float32")
    nq = sub.add_parser("nf4-quantize")
    nq.add_argument("--in", dest="in_path", required=True)
    nq.add_argument("--out", required=True)
    nq.set_defaults(threads=1, dtype="float32")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    try:
        if args.command == "train":
            as_json = args.output == "json"

            def emit(ev):
                if not as_json and ev["step"] == 1:
                    print(f"{'step':>6} {'loss':>10} {'lr':>11} {'grad_norm':>10} {'tokens':>7} "
                          f"{'tok/s':>9}")
                if as_json:
                    print(json.dumps(ev), flush=True)
                else:
                    print(f"{ev['step']:>6} {_fmt(ev['loss'], '10.6f')} {ev['lr']:11.4e} "
                          f"{_fmt(ev['grad_norm'], '10.4f')} {ev['tokens']:>7} "
                          f"{ev['tokens_per_s']:9.1f}", flush=True)

            result = train(args.spec, dtype=dtype, on_step=emit, adapter_out=args.adapter_out,
                           model_out=args.model_out, products=args.products)
            done = result["done"]
            if as_json:
                print(json.dumps(done), flush=True)
            else:
                print(f"done: {done['steps']} steps, final loss {_fmt(done['final_loss'], '.6f')}"
                      f", {done['tokens_per_s']:.1f} tokens/s, {done['seconds']:.1f} s")
        elif args.command == "optimizer-replay":
            optimizer_replay(args.in_path, args.out)
        elif args.command == "nf4-quantize":
            nf4_quantize_file(args.in_path, args.out)
        else:
            logits, loss, targets = score(args.model, args.adapter, args.data, args.seq_len,
                                          lora_alpha=args.lora_alpha,
                                          use_rslora=args.use_rslora, dtype=dtype)
            if args.logits_out:
                write_safetensors(args.logits_out,
                                  {f"logits.{i}": x for i, x in enumerate(logits)})
            if args.output == "json":
                print(json.dumps({"loss": loss, "targets": targets}))
            else:
                print(f"loss {_fmt(loss, '.6f')} over {targets} targets, {len(logits)} records")
    except ReferenceError as e:
        print(f"lathe_reference: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
