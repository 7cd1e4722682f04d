#!/usr/bin/env python3
"""Holds `lathe-worker score` to Hugging Face transformers' own modeling code (issue #28,
item 2; Qwen3, Gemma 2, Gemma 3 and Phi-3 by #31): the logits and the loss of small random
Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text) and Phi-3 models built and saved with
transformers' classes (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM), rather than to our
own Python reference (test_reference.py).

Run by ctest (label "reference") with the project venv's Python (torch, transformers,
safetensors), or by hand:
  LATHE_BIN_DIR=build/bin .venv/bin/python tests/reference/hf_architecture_test.py -v

What is held, float32 on both sides (Lathe's `score` always computes in float32):
  - logits, per record: max|lathe - hf| / max|hf| <= 1e-5 (LOGIT_REL_TOL, see there why
    normwise), against HF's "eager" and "sdpa" attention both (Gemma 2: "eager" only, as
    transformers has no sdpa for its soft-capped scores);
  - the scored loss (the mean next-token cross-entropy over every target of every record,
    labels of -100 skipped): |lathe - hf| <= 1e-5 * hf (LOSS_REL_TOL), where hf is
    sum over records of HF's `model(ids, labels=labels).loss` times the record's target
    count, over the total count (HF's loss is a per-record mean; Lathe's a per-target mean
    over the whole file, worker/engine/evaluation.cc);
  - a bf16 checkpoint (model.to(bfloat16).save_pretrained): Lathe widens the weights to
    float32 when it loads them for `score` (CausalLm::Load with the default ModelOptions;
    `score` has no bf16 compute path), so the judge is HF's model loaded from the same
    bf16 file with dtype=float32, under the same 1e-5 bounds. That the bf16 roundings move
    the logits by far more than the bound is checked too, so the file really is bf16.
    (HF computing in bf16 on the same file is another model: its logits differ from the
    float32 ones by 1.7e-2 to 5e-2 in the same measure, as 8-bit-mantissa roundings of
    every activation add up, and there is no Lathe bf16 scoring to hold to it.)

The cases (CASES) cover, among them: every model type the engine trains; hidden sizes,
intermediate sizes and vocabularies that are not powers of two or multiples of 8; GQA and
MQA and plain multi-head attention; head_dim != hidden / heads; Llama's attention_bias and
mlp_bias, Qwen2's q/k/v biases, Qwen3's RMSNorm on each head of q and k (and its
attention_bias); Gemma's scaled embeddings, (1 + weight) norms (four a block), GeGLU MLP,
query_pre_attn_scalar, sliding and global layers (layer_types), Gemma 2's soft-caps on the
scores and the logits, Gemma 3's q/k norms and its sliding layers' own RoPE base beside the
global layers' linear scaling; Phi-3's fused qkv_proj and gate_up_proj, partial rotary and
LongRoPE (records on both sides of its original length: short and long factors); tied and
untied embeddings; rope_scaling llama3 and linear; sliding windows smaller than the sequence
(Mistral, Qwen2 and Qwen3 use_sliding_window with max_window_layers 0); non-default
rms_norm_eps and rope_theta; one record of 400 tokens in some cases, past kCpuFusedAttentionMinTokens (384), where the engine's attention switches
from its explicit softmax to libtorch's fused scaled_dot_product_attention (with an
additive mask under a sliding window, without one otherwise).

Weights are re-drawn larger than transformers' std-0.02 init (which gives nearly uniform
logits, where a wrong epsilon or RoPE frequency barely shows): projections with std
gain / sqrt(fan_in), embeddings std 0.5, norm weights uniform in [0.8, 1.2] (Gemma's, which
multiply by 1 + weight, in [-0.2, 0.2]), biases std 0.3.
PlantedErrorTest keeps the tolerance honest: Lathe given a copy of a model whose config.json
says rms_norm_eps 1e-5 (the model's is 1e-3) or a rope_theta 1% off must exceed the logit
tolerance by at least PLANTED_MARGIN times.

Config spelling. Lathe reads config.json exactly as save_pretrained wrote it. Transformers
>= 5 writes RoPE's settings as one "rope_parameters" object ({"rope_type", "rope_theta",
"factor", ...}) instead of the top-level "rope_theta" and "rope_scaling" of earlier
versions; this test found the parser reading only the old keys (silently theta 10000, no
scaling: logit errors 0.36 to 1.04), and Qwen2's "layer_types", which transformers 5
follows over max_window_layers, ignored. LegacySpellingTest holds the earlier spelling to
the same logits; ConfigSpellingTest checks what transformers writes and that a Qwen2 window
on some layers only is refused by name rather than run as another model.

The tests need lathe-worker: they fail when LATHE_BIN_DIR is set (ctest) and it is
missing, and are skipped otherwise.
"""

import copy
import json
import math
import os
import shutil
import subprocess
import tempfile
import unittest

import torch

# The binaries' threads: the comparison does not depend on them, the runtime does.
torch.set_num_threads(1)

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("LATHE_SOURCE_DIR") or os.path.normpath(os.path.join(HERE, "..", ".."))
BIN_DIR_FROM_ENV = os.environ.get("LATHE_BIN_DIR")
BIN_DIR = BIN_DIR_FROM_ENV or os.path.join(SOURCE_DIR, "build", "bin")

# Logits, per record: max over the record's positions and vocabulary of |lathe - hf|,
# divided by max |hf| over the same. Normwise rather than elementwise: float32 rounding
# errors of a sum scale with the magnitude of its terms, not of its result, and a logit
# near zero is a sum of terms as large as any other's, so an elementwise relative bound
# would measure cancellation, not the implementation. Both sides compute in float32 (24-bit
# mantissa, unit roundoff 6e-8) and differ only in the order and blocking of their sums
# (oneDNN's products against ATen's, a fused RMSNorm and RoPE against HF's compositions):
# measured at most 1.4e-6 on these cases (an AVX512 CPU, 2026-11), so 1e-5 leaves room for
# other CPUs' blockings, while a wrong feature moves them by 5e-4 to 1 (PlantedErrorTest,
# and the RoPE settings the parser once ignored).
LOGIT_REL_TOL = 1e-5
# The scored loss (8 to 13 on these random models): relative 1e-5, the same requirement
# (measured below 1e-7). Lathe computes it by another path than its logits (the chunked
# linear cross-entropy, in float32, summed over records in double), HF by log_softmax of
# its logits.
LOSS_REL_TOL = 1e-5
# A planted error must exceed the tolerance by at least this factor.
PLANTED_MARGIN = 10.0

LONG_RECORD = 400  # past kCpuFusedAttentionMinTokens (common/plan.h): the fused attention

# Each case: model type, seed (of the weights and the records), transformers config
# arguments, the records' lengths. `rope_parameters` in transformers >= 5's spelling.
CASES = {
    # Llama with every bias, GQA (6 heads on 2), llama3 RoPE scaling whose original context
    # (32) puts head_dim 12's six frequencies in all three bands (kept, interpolated,
    # divided), odd sizes, non-default eps and theta, untied head.
    "llama_bias_gqa_llama3": dict(
        model_type="llama", seed=11,
        config=dict(vocab_size=389, hidden_size=72, intermediate_size=131, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, attention_bias=True,
                    mlp_bias=True, rms_norm_eps=1e-3, tie_word_embeddings=False,
                    max_position_embeddings=512,
                    rope_parameters=dict(rope_type="llama3", rope_theta=20000.0, factor=8.0,
                                         low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=32)),
        lengths=[48, 37, 20, 9, 2, 1]),
    # Llama with head_dim 16 != hidden 40 / 4 heads (q/k/v project to 64, o_proj back to
    # 40), plain multi-head attention, tied embeddings, linear RoPE scaling, no biases.
    "llama_tied_head_dim_linear": dict(
        model_type="llama", seed=12,
        config=dict(vocab_size=301, hidden_size=40, intermediate_size=77, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                    rms_norm_eps=1e-4, tie_word_embeddings=True, max_position_embeddings=512,
                    rope_parameters=dict(rope_type="linear", rope_theta=5000.0, factor=2.0)),
        lengths=[45, 31, 12, LONG_RECORD]),
    # Mistral with a sliding window of 7 (records up to 48 and one of 400: the explicit
    # softmax's mask and the fused attention's additive mask), MQA (4 heads on 1),
    # head_dim 18 != 56 / 4.
    "mistral_sliding_mqa": dict(
        model_type="mistral", seed=13,
        config=dict(vocab_size=263, hidden_size=56, intermediate_size=99, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=18,
                    sliding_window=7, rms_norm_eps=1e-3, tie_word_embeddings=False,
                    max_position_embeddings=512,
                    rope_parameters=dict(rope_type="default", rope_theta=1000.0)),
        lengths=[48, 29, 8, 7, LONG_RECORD]),
    # Qwen2 (q/k/v biases) with a sliding window of 11 on every layer (use_sliding_window,
    # max_window_layers 0), GQA (6 heads on 3), tied embeddings.
    "qwen2_tied_sliding": dict(
        model_type="qwen2", seed=14,
        config=dict(vocab_size=337, hidden_size=60, intermediate_size=85, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=3, use_sliding_window=True,
                    sliding_window=11, max_window_layers=0, rms_norm_eps=1e-3,
                    tie_word_embeddings=True, max_position_embeddings=512,
                    rope_parameters=dict(rope_type="default", rope_theta=30000.0)),
        lengths=[47, 26, 11, 3, LONG_RECORD]),
    # Qwen2 untied, no window, head_dim 22 != 88 / 4, an intermediate size below the hidden
    # size, rope_theta 1e6 and eps 1e-6 (Qwen2.5's), a 400-token record (the fused attention
    # without a mask).
    "qwen2_untied_head_dim": dict(
        model_type="qwen2", seed=15,
        config=dict(vocab_size=517, hidden_size=88, intermediate_size=45, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=22,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=512,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        lengths=[41, 30, 13, LONG_RECORD]),
    # Qwen3 (q_norm and k_norm over head_dim 16 != 48 / 6, before RoPE), GQA (6 heads on 2),
    # tied embeddings, a sliding window of 9 on every layer, eps 1e-3 (which the q/k norms
    # use too).
    "qwen3_tied_sliding": dict(
        model_type="qwen3", seed=16,
        config=dict(vocab_size=331, hidden_size=48, intermediate_size=83, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                    use_sliding_window=True, sliding_window=9, max_window_layers=0,
                    rms_norm_eps=1e-3, tie_word_embeddings=True, max_position_embeddings=512,
                    rope_parameters=dict(rope_type="default", rope_theta=20000.0)),
        lengths=[43, 27, 10, 4, LONG_RECORD]),
    # Qwen3 untied with attention_bias (q, k, v and o), GQA (4 heads on 2), head_dim 20 !=
    # 72 / 4, theta 1e6 (Qwen3's), a 400-token record (the fused attention without a mask).
    "qwen3_untied_bias": dict(
        model_type="qwen3", seed=17,
        config=dict(vocab_size=407, hidden_size=72, intermediate_size=101, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=20,
                    attention_bias=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    max_position_embeddings=512,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        lengths=[39, 28, 14, LONG_RECORD]),
    # Gemma 2: transformers' default layer_types (sliding, global, sliding) with a window of
    # 9, soft-caps small enough to act (scores capped at 3, logits at 5), scores scaled by
    # query_pre_attn_scalar 20 (not head_dim 24 != 64 / 4), GQA (4 heads on 2), tied, eps
    # 1e-3; the 400-token record stays on the explicit softmax (no fused soft-cap).
    "gemma2_softcap": dict(
        model_type="gemma2", seed=18,
        config=dict(vocab_size=353, hidden_size=64, intermediate_size=97, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                    query_pre_attn_scalar=20, attn_logit_softcapping=3.0,
                    final_logit_softcapping=5.0, sliding_window=9, rms_norm_eps=1e-3,
                    tie_word_embeddings=True, max_position_embeddings=512,
                    rope_parameters=dict(rope_type="default", rope_theta=20000.0)),
        lengths=[44, 29, 10, 4, LONG_RECORD]),
    # Gemma 3 (text): q_norm and k_norm (1 + weight) over head_dim 16 != 48 / 6, GQA (6
    # heads on 2), a window of 7 on layers 0 and 1, layer 2 global; the sliding layers' RoPE
    # base 1000, the global layer's 50000 with linear scaling 2; query_pre_attn_scalar 24;
    # untied; the 400-token record on the fused attention (scaled, masked on the sliding
    # layers, causal on the global one).
    "gemma3_local_rope": dict(
        model_type="gemma3_text", seed=19,
        config=dict(vocab_size=311, hidden_size=48, intermediate_size=91, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                    query_pre_attn_scalar=24, sliding_window=7,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rms_norm_eps=1e-3, tie_word_embeddings=False, max_position_embeddings=512,
                    rope_parameters=dict(
                        full_attention=dict(rope_type="linear", rope_theta=50000.0, factor=2.0),
                        sliding_attention=dict(rope_type="default", rope_theta=1000.0))),
        lengths=[41, 27, 12, 3, LONG_RECORD]),
    # Phi-3 mini's shape: fused qkv_proj and gate_up_proj, multi-head attention (4 heads of
    # 18), untied, a sliding window of 11 on every layer, no RoPE scaling, eps 1e-3.
    "phi3_sliding_mha": dict(
        model_type="phi3", seed=18,
        config=dict(vocab_size=353, hidden_size=72, intermediate_size=97, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, sliding_window=11,
                    rms_norm_eps=1e-3, tie_word_embeddings=False, max_position_embeddings=512,
                    pad_token_id=None, bos_token_id=None, eos_token_id=None,
                    rope_parameters=dict(rope_type="default", rope_theta=20000.0)),
        lengths=[37, 25, 12, LONG_RECORD]),
    # Phi-4-mini's: GQA (6 heads on 2), head_dim 16 of which 0.75 (12 features, 6
    # frequencies) rotate, LongRoPE with an original length of 32 (records of 43 and 400
    # take the long factors, 27 and 10 the short ones; factor 512 / 32 gives cos and sin
    # sqrt(1 + ln 16 / ln 32)), tied embeddings.
    "phi4_mini_longrope_tied": dict(
        model_type="phi3", seed=19,
        config=dict(vocab_size=331, hidden_size=96, intermediate_size=89, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, partial_rotary_factor=0.75,
                    original_max_position_embeddings=32, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=512, sliding_window=None,
                    pad_token_id=None, bos_token_id=None, eos_token_id=None,
                    rope_parameters=dict(
                        rope_type="longrope", rope_theta=10000.0,
                        short_factor=[1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
                        long_factor=[1.0, 1.5, 2.5, 4.0, 8.0, 16.0])),
        lengths=[43, 27, 10, LONG_RECORD]),
}

# Cases for ConfigSpellingTest alone.
V5_CASES = {
    # qwen2_tied_sliding with an explicit layer_types: the window on layer 1 only.
    # Transformers 5 writes layer_types into config.json and follows it over
    # max_window_layers (0 here).
    "qwen2_layer_types": dict(
        CASES["qwen2_tied_sliding"],
        config=dict(CASES["qwen2_tied_sliding"]["config"],
                    layer_types=["full_attention", "sliding_attention"])),
    # The same for Qwen3: the window on layer 0 only.
    "qwen3_layer_types": dict(
        CASES["qwen3_tied_sliding"],
        config=dict(CASES["qwen3_tied_sliding"]["config"],
                    layer_types=["sliding_attention", "full_attention"])),
}

CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
}


def attention_implementations(case):
    """HF's attention implementations to hold Lathe to: Gemma 2 has no sdpa (soft-caps)."""
    return ("eager",) if case["model_type"] == "gemma2" else ("eager", "sdpa")


# --------------------------------------------------------------------------------------
# Helpers


def need_worker(test):
    path = os.path.join(BIN_DIR, "lathe-worker")
    if os.access(path, os.X_OK):
        return path
    msg = f"missing lathe-worker in {BIN_DIR}"
    if BIN_DIR_FROM_ENV:
        test.fail(msg + " (LATHE_BIN_DIR is set: build it first)")
    raise unittest.SkipTest(msg)


def build_model(case):
    """A transformers model of `case` with weights large enough for errors to show."""
    config_class, model_class = CLASSES[case["model_type"]]
    config = config_class(**copy.deepcopy(case["config"]))
    torch.manual_seed(case["seed"])
    model = model_class(config).float().eval()
    generator = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        # named_parameters lists a tied head once (as the embeddings).
        gemma = case["model_type"].startswith("gemma")
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_((-0.2 if gemma else 0.8) + 0.4 * torch.rand(param.shape,
                                                                        generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            elif name == "model.embed_tokens.weight":
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            else:
                # Queries and keys larger, for attention that is neither uniform nor one-hot;
                # the head larger, for logits of std ~2-3 (up to 9-22 in absolute value).
                gain = (1.5 if any(p in name for p in ("q_proj", "k_proj", "qkv_proj"))
                        else 2.0 if name == "lm_head.weight" else 1.0)
                std = gain / math.sqrt(param.shape[1])
                param.copy_(std * torch.randn(param.shape, generator=generator))
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def legacy_rope_config(config):
    """`config` (a config.json dict as transformers >= 5 writes it) with RoPE's settings
    as top-level rope_theta and rope_scaling, the spelling of transformers < 5, which both
    transformers and Lathe read."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    return config


def gemma_legacy_config(config):
    """A Gemma config.json of transformers 5 in the spelling of transformers 4: RoPE's settings
    as top-level rope_theta and rope_scaling (Gemma 3: the global layers') and Gemma 3's
    rope_local_base_freq, and no layer_types (each family's default rule, Gemma 3's by
    sliding_window_pattern, must give the same layers)."""
    config = dict(config)
    rope = config.pop("rope_parameters")
    if config["model_type"] == "gemma3_text":
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
        types = config["layer_types"]
        config["sliding_window_pattern"] = types.index("full_attention") + 1
    rope = dict(rope)
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    del config["layer_types"]
    return config


def scale_rope_theta(config, factor):
    """`config` with every RoPE base of its rope_parameters (flat or per layer type) scaled."""
    rope = config["rope_parameters"]
    if "rope_theta" in rope:
        return {**config, "rope_parameters": {**rope, "rope_theta": rope["rope_theta"] * factor}}
    return {**config, "rope_parameters": {
        kind: {**params, "rope_theta": params["rope_theta"] * factor}
        for kind, params in rope.items()}}


def read_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def write_config(model_dir, config):
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def copy_with_config(src, dst, edit):
    """A copy of model directory `src` at `dst` whose config.json is edit(config)."""
    shutil.copytree(src, dst)
    write_config(dst, edit(read_config(src)))
    return dst


def make_records(case):
    """Token-id records of case["lengths"]: some with labels (a -100 prompt, some labels
    that are not the next input, one record with no target at all), some without (every
    next token is a target)."""
    generator = torch.Generator().manual_seed(1000 + case["seed"])
    vocab = case["config"]["vocab_size"]
    records = []
    for i, length in enumerate(case["lengths"]):
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        record = {"input_ids": ids}
        kind = i % 3
        if kind == 1 and length > 2:
            labels = list(ids)
            prompt = length // 3
            labels[:prompt] = [-100] * prompt
            # Labels need not be the inputs: a few replaced by other token ids.
            for j in torch.randint(prompt, length, (3,), generator=generator).tolist():
                labels[j] = (labels[j] + 7) % vocab
            record["labels"] = labels
        elif kind == 2 and length > 2:
            record["labels"] = [-100] * length if i == 2 else \
                [-100 if j % 2 else t for j, t in enumerate(ids)]
        records.append(record)
    return records


def write_records(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def lathe_score(model_dir, data, out, adapter=None):
    """Lathe's logits per record and its scored loss: (list of [len, vocab], json)."""
    cmd = [os.path.join(BIN_DIR, "lathe-worker"), "score", "--model", model_dir, "--data", data,
           "--logits-out", out, "--output", "json", "--threads", "1"]
    if adapter is not None:
        cmd += ["--adapter", adapter]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"lathe-worker score failed (exit {proc.returncode}):\n"
                             f"  $ {' '.join(cmd)}\nstdout:\n{proc.stdout}\n"
                             f"stderr:\n{proc.stderr}")
    lines = [l for l in proc.stdout.splitlines() if l.strip().startswith("{")]
    if not lines:
        raise AssertionError(f"lathe-worker score printed no JSON:\n{proc.stdout}")
    tensors = load_file(out)
    return [tensors[f"logits.{i}"] for i in range(len(tensors))], json.loads(lines[-1])


def hf_score(model, records):
    """HF's logits per record, and its loss over the records as Lathe averages it:
    (logits, loss, targets)."""
    logits, loss_sum, targets = [], 0.0, 0
    with torch.no_grad():
        for r in records:
            ids = torch.tensor([r["input_ids"]])
            labels = torch.tensor([r.get("labels", r["input_ids"])])
            n = int((labels[0, 1:] != -100).sum())
            out = model(input_ids=ids, labels=labels if n else None)
            logits.append(out.logits[0].float())
            if n:
                loss_sum += out.loss.double().item() * n
                targets += n
    return logits, loss_sum / targets, targets


def max_rel_error(lathe_logits, hf_logits):
    """max over records of max|lathe - hf| / max|hf|, and the worst record's index."""
    assert len(lathe_logits) == len(hf_logits), (len(lathe_logits), len(hf_logits))
    worst = (0.0, -1)
    for i, (a, b) in enumerate(zip(lathe_logits, hf_logits)):
        assert tuple(a.shape) == tuple(b.shape), (i, tuple(a.shape), tuple(b.shape))
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        worst = max(worst, (err, i))
    return worst


def with_attention(model, implementation):
    model.set_attn_implementation(implementation)
    assert model.config._attn_implementation == implementation, model.config._attn_implementation
    return model


# --------------------------------------------------------------------------------------
# The cases, built once per process


class Prepared:
    """One case: the HF model, its directories (as saved, in the legacy config spelling,
    bf16), its data, and Lathe's scores, each computed once."""

    def __init__(self, name, tmp):
        self.name = name
        self.case = CASES[name] if name in CASES else V5_CASES[name]
        self.tmp = os.path.join(tmp, name)
        os.makedirs(self.tmp)
        self.model = build_model(self.case)
        self.records = make_records(self.case)
        self.data = write_records(os.path.join(self.tmp, "data.jsonl"), self.records)
        self._hf = {}
        self._lathe = {}
        # As transformers writes it.
        self.dir = os.path.join(self.tmp, "model")
        self.model.save_pretrained(self.dir, safe_serialization=True)

    def bf16_dir(self):
        """The same model saved in bfloat16."""
        path = os.path.join(self.tmp, "bf16")
        if not os.path.isdir(path):
            copy.deepcopy(self.model).to(torch.bfloat16).save_pretrained(path,
                                                                         safe_serialization=True)
        return path

    def legacy_dir(self):
        """The same model, RoPE's settings in transformers < 5's spelling."""
        path = os.path.join(self.tmp, "legacy")
        return path if os.path.isdir(path) else copy_with_config(self.dir, path,
                                                                  legacy_rope_config)

    def hf(self, implementation="eager"):
        if implementation not in self._hf:
            self._hf[implementation] = hf_score(with_attention(self.model, implementation),
                                                self.records)
        return self._hf[implementation]

    def lathe(self, model_dir):
        if model_dir not in self._lathe:
            out = os.path.join(self.tmp, f"logits-{len(self._lathe)}.safetensors")
            self._lathe[model_dir] = lathe_score(model_dir, self.data, out)
        return self._lathe[model_dir]


_TMP = None
_PREPARED = {}


def prepared(name):
    global _TMP
    if _TMP is None:
        _TMP = tempfile.mkdtemp(prefix="lathe-hf-arch-")
    if name not in _PREPARED:
        _PREPARED[name] = Prepared(name, _TMP)
    return _PREPARED[name]


def tearDownModule():
    if _TMP is not None:
        shutil.rmtree(_TMP, ignore_errors=True)


class HfTestCase(unittest.TestCase):
    def setUp(self):
        need_worker(self)

    def assert_logits_match(self, lathe_logits, hf_logits, what):
        err, record = max_rel_error(lathe_logits, hf_logits)
        self.assertLessEqual(err, LOGIT_REL_TOL,
                             f"{what}: logits differ: max|lathe - hf| / max|hf| = {err:.3e} "
                             f"(record {record}) > {LOGIT_REL_TOL:g}")
        return err

    def assert_loss_matches(self, lathe, hf_loss, hf_targets, what):
        self.assertEqual(lathe["targets"], hf_targets, f"{what}: target count")
        err = abs(lathe["loss"] - hf_loss) / abs(hf_loss)
        self.assertLessEqual(err, LOSS_REL_TOL,
                             f"{what}: loss {lathe['loss']!r} vs HF's {hf_loss!r}: relative "
                             f"{err:.3e} > {LOSS_REL_TOL:g}")
        return err

    def check_case(self, name, model_dir=None, hf_model=None):
        p = prepared(name)
        lathe_logits, lathe = p.lathe(model_dir or p.dir)
        for implementation in attention_implementations(p.case):
            with self.subTest(case=name, attention=implementation):
                if hf_model is None:
                    hf_logits, hf_loss, hf_targets = p.hf(implementation)
                else:
                    hf_logits, hf_loss, hf_targets = hf_score(
                        with_attention(hf_model, implementation), p.records)
                self.assert_logits_match(lathe_logits, hf_logits, f"{name} ({implementation})")
                self.assert_loss_matches(lathe, hf_loss, hf_targets, f"{name} ({implementation})")


# --------------------------------------------------------------------------------------
# The tests


class ArchitectureTest(HfTestCase):
    """Lathe's logits and loss against transformers' on each case, float32 weights."""

    def test_llama_bias_gqa_llama3(self):
        self.check_case("llama_bias_gqa_llama3")

    def test_llama_tied_head_dim_linear(self):
        self.check_case("llama_tied_head_dim_linear")

    def test_mistral_sliding_mqa(self):
        self.check_case("mistral_sliding_mqa")

    def test_qwen2_tied_sliding(self):
        self.check_case("qwen2_tied_sliding")

    def test_qwen2_untied_head_dim(self):
        self.check_case("qwen2_untied_head_dim")

    def test_qwen3_tied_sliding(self):
        self.check_case("qwen3_tied_sliding")

    def test_qwen3_untied_bias(self):
        self.check_case("qwen3_untied_bias")

    def test_gemma2_softcap(self):
        self.check_case("gemma2_softcap")

    def test_gemma3_local_rope(self):
        self.check_case("gemma3_local_rope")
    def test_phi3_sliding_mha(self):
        self.check_case("phi3_sliding_mha")

    def test_phi4_mini_longrope_tied(self):
        self.check_case("phi4_mini_longrope_tied")


class Bf16CheckpointTest(HfTestCase):
    """A checkpoint stored in bfloat16: Lathe's score widens it to float32 on load, as HF's
    from_pretrained(dtype=float32) does; both then compute in float32 (bounds as above)."""

    def check_bf16(self, name):
        p = prepared(name)
        bf16_dir = p.bf16_dir()
        stored = load_file(os.path.join(bf16_dir, "model.safetensors"))
        self.assertTrue(all(t.dtype == torch.bfloat16 for t in stored.values()))
        hf_model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval()
        self.check_case(name, bf16_dir, hf_model)
        # The roundings matter: the float32 model's logits are far from these.
        err, _ = max_rel_error(p.lathe(bf16_dir)[0], p.hf()[0])
        self.assertGreater(err, PLANTED_MARGIN * LOGIT_REL_TOL)

    def test_llama_bias_gqa_llama3(self):
        self.check_bf16("llama_bias_gqa_llama3")

    def test_qwen2_tied_sliding(self):
        self.check_bf16("qwen2_tied_sliding")

    def test_qwen3_tied_sliding(self):
        self.check_bf16("qwen3_tied_sliding")

    def test_gemma2_softcap(self):
        self.check_bf16("gemma2_softcap")

    def test_gemma3_local_rope(self):
        self.check_bf16("gemma3_local_rope")
    def test_phi4_mini_longrope_tied(self):
        self.check_bf16("phi4_mini_longrope_tied")


class MergedModelTest(HfTestCase):
    """`lathe-worker merge`: a PEFT adapter folded into its base, written as a Hugging Face
    model directory (the base's dtype, safetensors shards with an index, the base's config
    and side files) that AutoModelForCausalLM loads and that computes what base and adapter
    computed together."""

    TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # Phi-3's projections as PEFT names them (B of qkv_proj: (heads + 2 kv_heads) x head_dim).
    PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]

    def adapter(self, p):
        """A PEFT adapter of the case's model, made and saved by PEFT (B non-zero)."""
        path = os.path.join(p.tmp, "adapter")
        if not os.path.isdir(path):
            torch.manual_seed(7)
            targets = self.PHI3_TARGETS if p.case["model_type"] == "phi3" else self.TARGETS
            peft_model = get_peft_model(copy.deepcopy(p.model), LoraConfig(
                r=4, lora_alpha=12, target_modules=targets, lora_dropout=0.0,
                init_lora_weights=False))
            peft_model.save_pretrained(path)
        return path

    def merge(self, p, base, out, *args):
        cmd = [os.path.join(BIN_DIR, "lathe-worker"), "merge", "--model", base, "--adapter",
               self.adapter(p), "--out", os.path.join(p.tmp, out), "--output", "json", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        return os.path.join(p.tmp, out), json.loads(proc.stdout)

    def test_float32_merge_computes_base_plus_adapter(self):
        # qwen3: q/k norms kept; gemma3: those and Gemma's four norms a block; phi4: LoRA on
        # the fused projections.
        for name in ("llama_bias_gqa_llama3", "qwen3_untied_bias", "gemma3_local_rope",
                     "phi4_mini_longrope_tied"):
            with self.subTest(case=name):
                self.check_float32_merge(name)

    def test_phi3_adapter_scores_as_peft(self):
        # PEFT's adapter on qkv_proj, o_proj, gate_up_proj and down_proj, applied by Lathe's
        # score (not merged): the logits and loss of PeftModel.
        for name in ("phi3_sliding_mha", "phi4_mini_longrope_tied"):
            with self.subTest(case=name):
                p = prepared(name)
                adapter = self.adapter(p)
                with open(os.path.join(adapter, "adapter_config.json")) as f:
                    self.assertEqual(sorted(json.load(f)["target_modules"]),
                                     sorted(self.PHI3_TARGETS))
                shapes = {k: tuple(v.shape) for k, v in load_file(
                    os.path.join(adapter, "adapter_model.safetensors")).items()}
                config = p.model.config
                head_dim = config.hidden_size // config.num_attention_heads
                self.assertEqual(
                    shapes["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"],
                    ((config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim, 4))
                peft = PeftModel.from_pretrained(copy.deepcopy(p.model), adapter).eval()
                out = os.path.join(p.tmp, "logits-adapter.safetensors")
                lathe_logits, lathe = lathe_score(p.dir, p.data, out, adapter=adapter)
                peft_logits, peft_loss, peft_targets = hf_score(peft, p.records)
                self.assert_logits_match(lathe_logits, peft_logits, f"{name} + adapter")
                self.assert_loss_matches(lathe, peft_loss, peft_targets, f"{name} + adapter")

    def check_float32_merge(self, name):
        p = prepared(name)
        merged, _ = self.merge(p, p.dir, "merged-f32")
        hf_merged, info = AutoModelForCausalLM.from_pretrained(
            merged, dtype=torch.float32, output_loading_info=True)
        self.assertEqual({k: v for k, v in info.items() if v}, {}, "keys not matched")
        peft = PeftModel.from_pretrained(copy.deepcopy(p.model), self.adapter(p)).eval()
        # Merged and unmerged sum the same terms in another order: the architecture bound.
        peft_logits, _, _ = hf_score(peft, p.records)
        merged_logits, _, _ = hf_score(hf_merged.eval(), p.records)
        self.assert_logits_match(merged_logits, peft_logits, "merged (HF) vs base + adapter")
        self.assert_logits_match(p.lathe(merged)[0], peft_logits, "merged (Lathe) vs PEFT")

    def test_bf16_base_gives_a_sharded_bf16_model(self):
        p = prepared("qwen2_tied_sliding")
        base = p.bf16_dir()
        merged, printed = self.merge(p, base, "merged-bf16", "--max-shard-bytes", "40000")
        self.assertEqual(printed["dtype"], "bfloat16")
        self.assertGreater(printed["files"], 1)
        with open(os.path.join(merged, "model.safetensors.index.json")) as f:
            weight_map = json.load(f)["weight_map"]
        self.assertEqual(len(set(weight_map.values())), printed["files"])
        self.assertEqual(read_config(merged)["dtype"], "bfloat16")
        self.assertEqual(read_config(merged)["rope_parameters"], read_config(base)["rope_parameters"])
        self.assertTrue(os.path.isfile(os.path.join(merged, "generation_config.json")))
        hf_merged, info = AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
        self.assertEqual({k: v for k, v in info.items() if v}, {}, "keys not matched")
        self.assertEqual(hf_merged.model.layers[0].self_attn.q_proj.weight.dtype, torch.bfloat16)
        # Lathe reads the sharded directory too, and computes what HF computes from it.
        hf_f32 = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        self.assert_logits_match(p.lathe(merged)[0], hf_score(hf_f32, p.records)[0],
                                 "sharded bf16 merge (Lathe vs HF)")
        # Each merged weight is W + (alpha / r) B A in float32, rounded once to bfloat16: equal
        # to torch's up to one bfloat16 step where the float32 sums round differently.
        adapter = load_file(os.path.join(self.adapter(p), "adapter_model.safetensors"))
        base_weights = {k: v.float() for k, v in load_file(
            os.path.join(base, "model.safetensors")).items()}
        merged_weights = {}
        for file in set(weight_map.values()):
            merged_weights.update(load_file(os.path.join(merged, file)))
        self.assertEqual(set(merged_weights), set(base_weights))
        checked = 0
        for name, weight in base_weights.items():
            expected = weight
            stem = name[:-len(".weight")]
            a = adapter.get(f"base_model.model.{stem}.lora_A.weight")
            if a is not None:
                b = adapter[f"base_model.model.{stem}.lora_B.weight"]
                expected = weight + (12 / 4) * (b.float() @ a.float())
                checked += 1
            expected = expected.to(torch.bfloat16).float()
            got = merged_weights[name].float()
            step = expected.abs().clamp_min(1e-30) * 2.0**-7  # one bfloat16 step at most
            self.assertTrue(bool(((got - expected).abs() <= step).all()), name)
        self.assertEqual(checked, 2 * len(self.TARGETS))


class PlantedErrorTest(HfTestCase):
    """The comparison detects a wrong RMSNorm epsilon or RoPE theta: Lathe given a copy of the
    model whose config.json has the planted value, HF the true one."""

    def check_planted(self, name, what, edit):
        """`edit(config)` plants `what` in the copy Lathe reads."""
        p = prepared(name)
        planted_dir = os.path.join(p.tmp, f"planted-{what}")
        if not os.path.isdir(planted_dir):
            copy_with_config(p.dir, planted_dir, edit)
        err, _ = max_rel_error(p.lathe(planted_dir)[0], p.hf()[0])
        self.assertGreater(err, PLANTED_MARGIN * LOGIT_REL_TOL,
                           f"{name}: a planted {what} moves the logits by only {err:.3e}")
        return err

    def test_rms_norm_eps(self):
        # The model's 1e-3 read as 1e-5.
        for name in ("llama_bias_gqa_llama3", "mistral_sliding_mqa", "qwen2_tied_sliding",
                     "qwen3_tied_sliding", "gemma2_softcap", "gemma3_local_rope",
                     "phi3_sliding_mha"):
            with self.subTest(case=name):
                self.assertEqual(CASES[name]["config"]["rms_norm_eps"], 1e-3)
                self.check_planted(name, "rms_norm_eps",
                                   lambda c: {**c, "rms_norm_eps": 1e-5})

    def test_rope_theta(self):
        # 1% off.
        for name in CASES:
            with self.subTest(case=name):
                self.check_planted(name, "rope_theta", lambda c: scale_rope_theta(c, 1.01))

    def test_gemma_settings(self):
        # Each of Gemma's own settings, 10% off (the sliding layers' RoPE base 1% off), or
        # the layer kinds swapped.
        def scaled(key, factor, integer=False):
            return lambda c: {**c, key: (round if integer else float)(c[key] * factor)}

        def swapped_layers(c):
            return {**c, "layer_types": ["full_attention" if t == "sliding_attention"
                                         else "sliding_attention" for t in c["layer_types"]]}

        def local_base(c):
            rope = c["rope_parameters"]
            sliding = rope["sliding_attention"]
            return {**c, "rope_parameters": {
                **rope, "sliding_attention": {**sliding,
                                              "rope_theta": sliding["rope_theta"] * 1.01}}}

        planted = [
            ("gemma2_softcap", "query_pre_attn_scalar",
             scaled("query_pre_attn_scalar", 1.1, integer=True)),
            ("gemma2_softcap", "attn_logit_softcapping", scaled("attn_logit_softcapping", 1.1)),
            ("gemma2_softcap", "final_logit_softcapping",
             scaled("final_logit_softcapping", 1.1)),
            ("gemma2_softcap", "layer_types", swapped_layers),
            ("gemma3_local_rope", "query_pre_attn_scalar",
             scaled("query_pre_attn_scalar", 1.1, integer=True)),
            ("gemma3_local_rope", "rope_local_base_freq", local_base),
            ("gemma3_local_rope", "layer_types", swapped_layers),
        ]
        for name, what, edit in planted:
            with self.subTest(case=name, planted=what):
                self.check_planted(name, what, edit)


class Phi3RopeTest(HfTestCase):
    """Phi-3's partial rotary and LongRoPE settings each act: a planted partial factor, long
    factor or original length moves Lathe's logits away from HF's (the short and the long
    factors each have records that use them)."""

    def test_planted_rope_settings(self):
        name = "phi4_mini_longrope_tied"
        plants = {
            "partial_rotary_factor": lambda c: {**c, "partial_rotary_factor": 1.0, "rope_parameters": {
                **c["rope_parameters"], "partial_rotary_factor": 1.0,
                "short_factor": c["rope_parameters"]["short_factor"] + [1.0, 1.0],
                "long_factor": c["rope_parameters"]["long_factor"] + [1.0, 1.0]}},
            "long_factor": lambda c: {**c, "rope_parameters": {
                **c["rope_parameters"], "long_factor": [1.0] * 6}},
            "short_factor": lambda c: {**c, "rope_parameters": {
                **c["rope_parameters"], "short_factor": [1.0] * 6}},
            "original_max_position_embeddings": lambda c: {
                **c, "original_max_position_embeddings": 64},
        }
        for what, edit in plants.items():
            with self.subTest(planted=what):
                PlantedErrorTest.check_planted(self, name, what, edit)

    def test_legacy_rope_scaling(self):
        # transformers < 5's spelling: "rope_scaling" with "type": "longrope" (Phi-4-mini's
        # config.json) and top-level rope_theta and partial_rotary_factor.
        name = "phi4_mini_longrope_tied"
        p = prepared(name)
        legacy = p.legacy_dir()
        config = read_config(legacy)
        self.assertEqual(config["rope_scaling"]["rope_type"], "longrope")
        self.assertEqual(config["partial_rotary_factor"], 0.75)
        self.check_case(name, legacy)

    def test_biases_are_refused(self):
        # Phi-4-mini's config.json carries its remote code's bias switches; on, they are
        # refused by name rather than ignored.
        p = prepared("phi3_sliding_mha")
        biased = os.path.join(p.tmp, "biased")
        if not os.path.isdir(biased):
            copy_with_config(p.dir, biased, lambda c: {**c, "attention_bias": True})
        with self.assertRaises(AssertionError) as refused:
            lathe_score(biased, p.data, os.path.join(p.tmp, "biased.safetensors"))
        self.assertIn("attention_bias: true is not supported for phi3", str(refused.exception))


class LegacySpellingTest(HfTestCase):
    """config.json in transformers < 5's spelling (top-level rope_theta and rope_scaling),
    which both transformers and Lathe still read, gives the same logits."""

    def test_llama3_scaling_and_theta(self):
        for name in ("llama_bias_gqa_llama3", "llama_tied_head_dim_linear"):
            with self.subTest(case=name):
                p = prepared(name)
                legacy = p.legacy_dir()
                self.assertEqual(AutoConfig.from_pretrained(legacy).rope_parameters,
                                 p.model.config.rope_parameters)
                self.check_case(name, legacy)

    def test_gemma_without_layer_types(self):
        # Gemma 2's alternation and Gemma 3's sliding_window_pattern (3 here) give the cases'
        # layer kinds; Gemma 3's rope_local_base_freq its sliding layers' base.
        for name in ("gemma2_softcap", "gemma3_local_rope"):
            with self.subTest(case=name):
                p = prepared(name)
                legacy = os.path.join(p.tmp, "legacy-gemma")
                if not os.path.isdir(legacy):
                    copy_with_config(p.dir, legacy, gemma_legacy_config)
                self.assertNotIn("layer_types", read_config(legacy))
                loaded = AutoConfig.from_pretrained(legacy)
                self.assertEqual(loaded.layer_types, p.model.config.layer_types)
                self.assertEqual(loaded.rope_parameters, p.model.config.rope_parameters)
                self.check_case(name, legacy)


class ConfigSpellingTest(HfTestCase):
    """What the cases rely on transformers 5 writing, and a Qwen2 "layer_types" that Lathe
    cannot run as written."""

    def test_written_config(self):
        config = read_config(prepared("qwen2_tied_sliding").dir)
        self.assertEqual(config["rope_parameters"], {"rope_type": "default", "rope_theta": 30000.0})
        self.assertNotIn("rope_theta", config)
        self.assertNotIn("rope_scaling", config)
        self.assertEqual(config["layer_types"], ["sliding_attention"] * 2)
        self.assertEqual(read_config(prepared("llama_bias_gqa_llama3").dir)["rope_parameters"],
                         CASES["llama_bias_gqa_llama3"]["config"]["rope_parameters"])

    def test_qwen2_window_on_some_layers_is_refused(self):
        # layer_types puts the window on layer 1 only (max_window_layers 0 says both):
        # transformers follows layer_types, Lathe cannot represent it and must say so, not
        # run a model with the window on both (which it did: max logit error 0.91).
        p = prepared("qwen2_layer_types")
        with self.assertRaises(AssertionError) as refused:
            p.lathe(p.dir)
        self.assertIn("layer_types: a sliding window on layers 1 only is not supported",
                      str(refused.exception))

    def test_qwen3_window_on_some_layers_is_refused(self):
        p = prepared("qwen3_layer_types")
        with self.assertRaises(AssertionError) as refused:
            p.lathe(p.dir)
        self.assertIn("layer_types: a sliding window on layers 0 only is not supported",
                      str(refused.exception))

    def test_qwen3_written_config(self):
        # What the Qwen3 cases rely on: head_dim and the window written as given.
        config = read_config(prepared("qwen3_tied_sliding").dir)
        self.assertEqual(config["model_type"], "qwen3")
        self.assertEqual(config["head_dim"], 16)
        self.assertEqual(config["layer_types"], ["sliding_attention"] * 2)
        self.assertFalse(config["attention_bias"])

    def test_gemma_written_config(self):
        # What the Gemma cases rely on: transformers' default layer_types written out (Gemma
        # 2), Gemma 3's RoPE per layer type, the settings as given.
        gemma2 = read_config(prepared("gemma2_softcap").dir)
        self.assertEqual(gemma2["layer_types"],
                         ["sliding_attention", "full_attention", "sliding_attention"])
        self.assertEqual(gemma2["hidden_activation"], "gelu_pytorch_tanh")
        self.assertEqual(gemma2["final_logit_softcapping"], 5.0)
        gemma3 = read_config(prepared("gemma3_local_rope").dir)
        self.assertEqual(gemma3["model_type"], "gemma3_text")
        self.assertEqual(gemma3["rope_parameters"],
                         CASES["gemma3_local_rope"]["config"]["rope_parameters"])
        self.assertIsNone(gemma3["attn_logit_softcapping"])

    def test_multimodal_gemma3_is_refused(self):
        # The model_type of the multimodal Gemma 3 names a model the engine does not run.
        p = prepared("gemma3_local_rope")
        multimodal = os.path.join(p.tmp, "multimodal")
        if not os.path.isdir(multimodal):
            copy_with_config(p.dir, multimodal, lambda c: {**c, "model_type": "gemma3"})
        with self.assertRaises(AssertionError) as refused:
            p.lathe(multimodal)
        self.assertIn('model_type: "gemma3" is the multimodal Gemma 3: only its text model '
                      '(model_type gemma3_text, Gemma3ForCausalLM) is supported',
                      str(refused.exception))


if __name__ == "__main__":
    unittest.main(verbosity=2)
