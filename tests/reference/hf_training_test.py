#!/usr/bin/env python3
"""Holds `lathe-worker train` to Hugging Face PEFT and plain PyTorch training, and Lathe's
exported adapters to PEFT's loader (issue #28, items 3 and 4), rather than to our own Python
reference (test_reference.py).

Run by ctest (label "reference") with the project venv's Python (torch, transformers, peft,
safetensors), or by hand:
  LATHE_BIN_DIR=build/bin .venv/bin/python tests/reference/hf_training_test.py -v

The judge of training (item 3) is a plain PyTorch loop, written here (hf_train), over
transformers' own model classes: PEFT's LoRA model for LoRA (the starting adapter made by
`get_peft_model(model, LoraConfig(...))` and saved, read back with
`PeftModel.from_pretrained(model, dir, is_trainable=True)`), the bare model for full
fine-tuning; `torch.optim.AdamW` (single-tensor, as docs/training.md names it) with the
parameter groups of transformers' Trainer (Trainer.get_decay_parameter_names: no decay on
biases and norms), `torch.nn.utils.clip_grad_norm_`, transformers' `get_scheduler`, and the
loss HF's model computes, `model(input_ids, attention_mask, labels=labels).loss` (the mean
over every target of the batch, -100 ignored, labels shifted inside the model). Each
optimizer step feeds that loop the step's whole global batch as one right-padded batch, so
the HF loss is the mean over the step's targets, which is what Lathe's micro-batches with
gradient accumulation must add up to (docs/training.md, "Loss": each micro-batch's summed
loss divided by the whole step's target count; trainer.cc, TrainStep). The step's sequences
are those of docs/training.md, "Order" and "Sequences" (SplitMix64 Fisher-Yates per epoch,
packed or not; lathe_sequences below): the global batch (4) is smaller than the data set
(10 records), so the steps see different data, and the run crosses epoch boundaries.

Every job starts from the same weights on both sides: the base model saved with
save_pretrained (weights re-drawn as in hf_architecture_test.py, so that the numbers are not
trivially small) and, for LoRA, an adapter made by PEFT itself (init_lora_weights=False: B is
not zero, so A has a gradient too) and saved with save_pretrained, which Lathe reads through
`lora.init_from`. The jobs (JOBS): LoRA on every projection of a Llama (unpacked, gradient
accumulation over 2 micro-batches, clipping, weight decay, non-default betas and eps); rsLoRA
on 4 projections of a tied Qwen2 (packed, accumulation over 4, cosine schedule with warmup);
full fine-tuning of the tied Qwen2 (biases and norms exempt from decay); QLoRA as the Llama
LoRA; and ZeRO-3 on 2 ranks (two `lathe-worker train --rank R --world-size 2
--rendezvous-dir D` processes) for the Llama LoRA and the Qwen2 full job, held to the same
HF loops and tolerances as one process. Qwen3 (#31; q_norm and k_norm on each head) runs
LoRA, QLoRA and full fine-tuning as the Llama LoRA and Qwen2 full jobs, each also under
ZeRO-3 (LoRA and full) on 2 ranks. PEFT's options (#31): a Llama LoRA whose target_modules
is a regular expression, with a rank_pattern, an alpha_pattern and rsLoRA (each module's own
rank and scaling), whose exported adapter PEFT loads with the same string and maps. Gemma 2 (#31; four (1 + weight) norms a block, GeGLU,
soft-capped scores and logits, a sliding and a global layer) runs the same LoRA, QLoRA and
full jobs, and full fine-tuning under ZeRO-3 (its trained norms sharded; the frozen ones of
LoRA under ZeRO-3 are Qwen3's case already). A Phi-4-mini-like Phi-3 (#31: fused qkv_proj and
gate_up_proj, partial rotary, LongRoPE, tied) runs the LoRA, QLoRA and full jobs, each also
under ZeRO-3 (LoRA and full) on 2 ranks, its LoRA job on the spec's default targets (every
projection of the model: the four fused ones, as the exported adapter_config.json says and
PEFT loads). PEFT's modules_to_save (#31): the Llama LoRA job with a trained copy of its LM
head (also under ZeRO-3 on 2 ranks), and the tied Qwen2's rsLoRA job with copies of
embed_tokens and lm_head, which PEFT 0.21 trains apart (each replaces one use of the tied
weight); their adapters (the copies under PEFT's keys) load in PEFT, and PEFT's own trained
one in `lathe-worker score`.

What is held (float32 on both sides):
  - each step's loss (computed before its update), relative STEP_LOSS_REL_TOL; its gradient
    norm (before clipping), relative GRAD_NORM_REL_TOL (LATER_GRAD_NORM_REL_TOL after the
    first step); its learning rate, relative 1e-12;
  - the first step's gradients (after clipping, as the update uses them), per tensor
    max|lathe - hf| / max|hf| <= GRAD_REL_TOL. Lathe's trainer does not print gradients;
    its checkpoint after step 1 (train.checkpoint_every: 1) holds AdamW's exp_avg, which
    after one step is lerp(0, g, 1 - beta1) = (1 - beta1) g rounded once: the gradient
    divided by 1 - beta1 within one float32 rounding (6e-8 relative), compared with HF's
    p.grad. (ZeRO-3's checkpoints hold slices of flat buffers: its runs are held on the
    rest.);
  - the trained tensors after 5 AdamW steps: the adapter Lathe exports (LoRA, QLoRA,
    ZeRO-3's gathered one) against the HF loop's LoRA tensors, or the full model Lathe
    exports (read by transformers' from_pretrained with every key matched; ZeRO-3's in
    shards with an index) against the HF loop's weights, element by element within the
    summed learning rate times (WEIGHT_TOL_OF_UPDATE + Adam's amplification of the
    gradient's rounding for that element): see WEIGHT_TOL_OF_UPDATE for why relative to the
    update and not to the weights, and the error model.
PlantedErrorTest shows these bounds catch plausible mistakes of the HF loop's size: the loss
averaged per micro-batch, a LoRA scaling 1% off, another data order, weight decay on biases
and norms, another beta1, beta2 or eps.

Item 4, the round trip:
  - every adapter Lathe exports loads in `PeftModel.from_pretrained(base, dir)` with every key
    matched (no PEFT warning; load_adapter's load_result without missing or unexpected keys;
    PEFT's own state dict holds exactly the file's tensors, bit for bit), and PEFT's loss on
    an eval file equals `lathe-worker score --model BASE --adapter DIR`'s within
    SCORE_LOSS_REL_TOL, its logits within LOGIT_REL_TOL (normwise, as hf_architecture_test);
  - adapters made by PEFT (randomly initialised; trained in the HF loop, with use_rslora and
    a subset of targets) load in `lathe-worker score --adapter` with the same loss and logits
    as PeftModel.

QLoRA. Lathe trains the adapter over NF4-quantized projections (docs/training.md, "QLoRA"),
computing with their float32 dequantized values; `lathe-nf4-quantize` (this directory) writes
those values. The training judge is therefore PEFT's LoRA over the dequantized base (a copy of
the base model whose seven projections are the NF4 round trip), the same loop and tolerances
as LoRA: without the quantization the first loss alone is off by far more (checked). The
exported adapter is a plain PEFT adapter (Lathe exports no quantization config): the round
trip loads it onto the unquantized base, the one PEFT loads it onto by default and a user
merges it into, and onto the dequantized one it was trained over, and holds PEFT's loss on
each to `lathe-worker score`'s on the same base. PEFT over a bitsandbytes 4-bit base is not
the judge here: bitsandbytes' CPU dequantization was found unreliable (bnb_nf4_test.py, which
holds Lathe's NF4 codes to bitsandbytes' quantization instead).

The tests need lathe-worker (QLoRA also lathe-nf4-quantize): they fail when LATHE_BIN_DIR is
set (ctest) and a binary is missing, and are skipped otherwise.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings

import torch

torch.set_num_threads(1)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_architecture_test as arch  # noqa: E402  (build_model, hf_score, max_rel_error)
import trainer_events  # noqa: E402

import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, get_scheduler  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

BIN_DIR_FROM_ENV = os.environ.get("LATHE_BIN_DIR")
BIN_DIR = arch.BIN_DIR

# Tolerances --------------------------------------------------------------------------------

# A step's loss: as hf_architecture_test's scored loss (relative 1e-5). At step 1 only the
# forward passes differ; later steps add the weights' differences (below), which move a loss
# by far less (measured at most 3.5e-7 on any step of any job).
STEP_LOSS_REL_TOL = 1e-5
# Gradients, per tensor: max|lathe - hf| / max|hf|. Normwise for the reason the logits are
# (hf_architecture_test.LOGIT_REL_TOL): an element's rounding error scales with the terms of
# its sum, not with the sum, and an element near zero is a sum of terms as large as any
# other's. Each element is a float32 sum over the step's positions of products of activations
# and back-propagated errors, computed in another order and blocking (oneDNN and the fused
# kernels against ATen): measured at most 3e-6, while a wrong LoRA scaling, label shift or
# loss normalisation is wrong by 1e-2 or more.
GRAD_REL_TOL = 1e-5
# The gradient norm before clipping, a sum of squares of those gradients: relative 1e-5 at the
# first step (measured at most 2e-7). Later steps evaluate it at weights that differ as the
# trained tensors below do, through elements whose update rounding decides: measured up to
# 3.1e-6 (ZeRO-3, step 2), held to 3e-5.
GRAD_NORM_REL_TOL = 1e-5
LATER_GRAD_NORM_REL_TOL = 3e-5
# The trained tensors after STEPS AdamW steps, element by element, relative to how far
# training can move an element: about lr_k at step k (Adam's update is lr_k * m_hat /
# (sqrt(v_hat) + eps), with |m_hat| <= sqrt(v_hat) at the first step and near it after), so
# in units of the summed learning rate L = sum_k lr_k (lr * steps under a constant schedule),
# not of the weights (LoRA's B and A of 0.1-0.5 move by 1e-2: a bound relative to the weights
# would hide a wrong update). Adam divides each element's gradient by that element's own size,
# so it amplifies the gradient's rounding error where the gradient is small: if each gradient
# element is off by at most GRAD_REL_TOL * G (G: the tensor's largest gradient element so
# far, the scale of the normwise bound above), then m_hat and sqrt(v_hat) are each off by at
# most that much, and m_hat / (sqrt(v_hat) + eps) by at most 2 GRAD_REL_TOL G /
# (sqrt(v_hat) + eps) (to first order). Hence, per element,
#   |lathe - hf| <= WEIGHT_TOL_OF_UPDATE * L
#                   + sum_k lr_k * 2 GRAD_REL_TOL G_k / (sqrt(v_hat_k) + eps)
# with v_hat_k the HF loop's own bias-corrected second moment of that element after step k
# (hf_train accumulates it). The second term is the amplified rounding; the first the floor
# for what that model leaves out (second-order terms, the weights' own rounding, one step's
# difference fed back into the next gradients). For an element whose gradient is within 1/100
# of its tensor's largest, the second term is at most 2e-3 L, so a wrong learning rate, beta,
# eps, bias correction or weight decay (each off by 1e-2 to 1 of L on many elements) fails
# (PlantedErrorTest); an element whose gradient is as small as the rounding (a RoPE frequency
# that barely turns over 32 positions leaves some of Qwen2's k_proj bias elements with 1e-5
# of the largest gradient; some LoRA elements have a first gradient 2e-5 of their tensor's
# largest) gets a bound of the size of its update, since rounding decides its direction.
# Measured: every element within 0.16 of its bound (the worst, ZeRO-3 LoRA), and the elements
# whose bound is at most twice the floor within 1.3e-4 L (8x under the floor). (A bound of
# 1e-3 L on every element fails QLoRA's run at 1.45e-3 L, on a gate_proj A element whose
# first gradient is 1.9e-5 of its tensor's largest, and the full Qwen2's at 6.9e-3 L, on a
# k_proj bias element, both elements whose update direction rounding decides.)
WEIGHT_TOL_OF_UPDATE = 1e-3
# The round trip: the brief's 1e-5 relative on the scored loss, hf_architecture_test's 1e-5
# normwise on the logits.
SCORE_LOSS_REL_TOL = 1e-5
LOGIT_REL_TOL = arch.LOGIT_REL_TOL

# The models --------------------------------------------------------------------------------

# Small (2 layers, hidden 48-64, vocab 256-320), sizes that are not powers of two, GQA.
MODELS = {
    # Llama: untied head, no biases.
    "llama": dict(model_type="llama", seed=31,
                  config=dict(vocab_size=256, hidden_size=48, intermediate_size=88,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              rms_norm_eps=1e-5, tie_word_embeddings=False,
                              max_position_embeddings=64,
                              rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # Qwen2: q/k/v biases (no weight decay on them), tied embeddings (one tensor, its
    # gradient the sum of the embedding's and the head's).
    "qwen2": dict(model_type="qwen2", seed=32,
                  config=dict(vocab_size=320, hidden_size=64, intermediate_size=72,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              rms_norm_eps=1e-6, tie_word_embeddings=True,
                              max_position_embeddings=64,
                              rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    # Qwen3: q_norm and k_norm over head_dim 18 != 56 / 4 (trained, without weight decay, in
    # full fine-tuning; frozen base weights of every unit under LoRA), untied, no biases.
    "qwen3": dict(model_type="qwen3", seed=33,
                  config=dict(vocab_size=288, hidden_size=56, intermediate_size=80,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=18, rms_norm_eps=1e-6, tie_word_embeddings=False,
                              max_position_embeddings=64,
                              rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    # Gemma 2: layer 0 sliding (window 8 < SEQ_LEN), layer 1 global; scores soft-capped at 3
    # and logits at 5 (both act on these weights: the loss's gradient goes through the cap);
    # query_pre_attn_scalar 20, head_dim 16 != 48 / 4; tied embeddings, as Gemma's.
    "gemma2": dict(model_type="gemma2", seed=34,
                   config=dict(vocab_size=296, hidden_size=48, intermediate_size=76,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, query_pre_attn_scalar=20, sliding_window=8,
                               attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                               rms_norm_eps=1e-6, tie_word_embeddings=True,
                               max_position_embeddings=64,
                               rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # Phi-3 as Phi-4-mini: fused qkv_proj and gate_up_proj, GQA, head_dim 16 of which 0.75
    # rotate (6 frequencies), LongRoPE with an original length of 8 (every training
    # sequence, 9 to 32 tokens, takes the long factors, whatever its micro-batch: the set is
    # chosen per batch by its width, as transformers does; the eval record of 5 the short),
    # tied embeddings.
    "phi3": dict(model_type="phi3", seed=34,
                 config=dict(vocab_size=304, hidden_size=64, intermediate_size=76,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             partial_rotary_factor=0.75, original_max_position_embeddings=8,
                             rms_norm_eps=1e-5, tie_word_embeddings=True,
                             max_position_embeddings=64, sliding_window=None,
                             pad_token_id=None, bos_token_id=None, eos_token_id=None,
                             rope_parameters=dict(
                                 rope_type="longrope", rope_theta=10000.0,
                                 short_factor=[1.0, 1.1, 1.2, 1.4, 1.7, 2.0],
                                 long_factor=[1.0, 1.5, 2.0, 3.0, 5.0, 8.0]))),
}

SEQ_LEN = 32
STEPS = 5
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]

# The training data: 10 records, two longer than SEQ_LEN (truncated when unpacked), some
# with -100 prompts and labels other than the inputs. Global batch 4 < 10, so the 5 steps
# see different sequences and cross an epoch boundary (20 sequences unpacked).
TRAIN_LENGTHS = [40, 31, 25, 18, 12, 33, 28, 9, 22, 16]
# The eval data for the round trip: scored in file order, one record at a time.
EVAL_LENGTHS = [30, 17, 9, 26, 5]

# Each job: a model, a method and the train/lora settings of its spec. Lathe's spec and the
# HF loop are both made from it.
JOBS = {
    # LoRA on every projection, unpacked, micro-batch 2 of global 4 (gradient accumulation
    # over 2), non-default betas and eps, weight decay, clipping (gradient norms of 6 to 10:
    # every update is of clipped gradients).
    "lora_llama": dict(
        model="llama", method="lora", pack=False,
        lora=dict(rank=8, alpha=16, targets=ALL_TARGETS, use_rslora=False),
        train=dict(global_batch=4, micro_batch=2, lr=2e-3, adam_beta1=0.85, adam_beta2=0.99,
                   adam_eps=1e-7, weight_decay=0.1, max_grad_norm=1.0,
                   schedule=dict(kind="constant", warmup_steps=0))),
    # LoRA on a subset, rsLoRA scaling (alpha / sqrt(r)), packed sequences, a cosine schedule
    # with warmup (transformers' get_scheduler on the HF side), micro-batch 1 (accumulation
    # over 4), no clipping.
    "lora_qwen2": dict(
        model="qwen2", method="lora", pack=True,
        lora=dict(rank=4, alpha=6, targets=["q_proj", "v_proj", "o_proj", "down_proj"],
                  use_rslora=True),
        train=dict(global_batch=4, micro_batch=1, lr=3e-3, adam_beta1=0.9, adam_beta2=0.999,
                   adam_eps=1e-8, weight_decay=0.0, max_grad_norm=0.0,
                   schedule=dict(kind="cosine", warmup_steps=2))),
    # Every weight of the tied Qwen2: biases and norms without weight decay, the tied
    # embedding decayed; unpacked, accumulation over 2, clipping (norms of 10 to 17).
    "full_qwen2": dict(
        model="qwen2", method="full", pack=False,
        train=dict(global_batch=4, micro_batch=2, lr=1e-3, adam_beta1=0.9, adam_beta2=0.99,
                   adam_eps=1e-8, weight_decay=0.05, max_grad_norm=1.0,
                   schedule=dict(kind="constant", warmup_steps=0))),
    # lora_llama's configuration over the NF4 base.
    "qlora_llama": dict(
        model="llama", method="qlora", pack=False,
        lora=dict(rank=8, alpha=16, targets=ALL_TARGETS, use_rslora=False),
        train=dict(global_batch=4, micro_batch=2, lr=2e-3, adam_beta1=0.85, adam_beta2=0.99,
                   adam_eps=1e-7, weight_decay=0.1, max_grad_norm=1.0,
                   schedule=dict(kind="constant", warmup_steps=0))),
}
# PEFT's target_modules as a regular expression (a full match over the module's full name):
# q_proj and v_proj of the first two of the Llama's three layers; v_proj at rank 2 by a
# rank_pattern, layer 1 at alpha 3 by an alpha_pattern, all with rsLoRA (alpha / sqrt(r) per
# module). The spec says the same; the exported adapter_config.json carries it as PEFT does.
JOBS["lora_llama_regex"] = dict(
    JOBS["lora_llama"],
    lora=dict(rank=4, alpha=6, targets=r".*\.layers\.(0|1)\.self_attn\.(q|v)_proj",
              use_rslora=True, rank_pattern={"v_proj": 2},
              alpha_pattern={r"layers\.1\..*": 3}))
# Qwen3: lora_llama's LoRA (every projection, accumulation over 2, clipping, decay), its
# QLoRA, and full fine-tuning as full_qwen2's (the q/k norms trained, exempt from decay).
for _name, _like in (("lora_qwen3", "lora_llama"), ("qlora_qwen3", "qlora_llama"),
                     ("full_qwen3", "full_qwen2")):
    JOBS[_name] = dict(JOBS[_like], model="qwen3")
# Gemma 2: the same three.
for _name, _like in (("lora_gemma2", "lora_llama"), ("qlora_gemma2", "qlora_llama"),
                     ("full_gemma2", "full_qwen2")):
    JOBS[_name] = dict(JOBS[_like], model="gemma2")
# Phi-3: the same three on its fused projections; the LoRA job's spec names no targets (the
# default: every projection of the model), PEFT's names the four.
for _name, _like in (("lora_phi3", "lora_llama"), ("qlora_phi3", "qlora_llama"),
                     ("full_phi3", "full_qwen2")):
    JOBS[_name] = dict(JOBS[_like], model="phi3")
    if "lora" in JOBS[_name]:
        JOBS[_name]["lora"] = dict(JOBS[_name]["lora"], targets=PHI3_TARGETS)
JOBS["lora_phi3"]["spec_default_targets"] = True
# PEFT's modules_to_save (#31): lora_llama with a trained copy of the untied LM head; the
# packed rsLoRA job of the tied Qwen2 with copies of both uses of its one tied weight, which
# PEFT 0.21 (no ensure_weight_tying) trains apart: the lookup by the embed_tokens copy, the
# head's product by the lm_head copy, each starting as the tied weight.
JOBS["lora_llama_mts"] = dict(JOBS["lora_llama"],
                              lora=dict(JOBS["lora_llama"]["lora"], modules_to_save=["lm_head"]))
JOBS["lora_qwen2_mts"] = dict(JOBS["lora_qwen2"],
                              lora=dict(JOBS["lora_qwen2"]["lora"],
                                        modules_to_save=["embed_tokens", "lm_head"]))
# The ZeRO-3 runs: the same jobs on 2 ranks (a rank's half of the global batch, in
# micro-batches of 1 for LoRA, of 2 for full), so the HF loop's result is the same.
ZERO3_JOBS = {
    "lora_llama_zero3": ("lora_llama", dict(micro_batch=1)),
    "full_qwen2_zero3": ("full_qwen2", dict(micro_batch=2)),
    "lora_qwen3_zero3": ("lora_qwen3", dict(micro_batch=1)),
    "full_qwen3_zero3": ("full_qwen3", dict(micro_batch=2)),
    # Adapters of different ranks in ZeRO-3's flat units (#31).
    "lora_llama_regex_zero3": ("lora_llama_regex", dict(micro_batch=1)),
    "full_gemma2_zero3": ("full_gemma2", dict(micro_batch=2)),
    "lora_phi3_zero3": ("lora_phi3", dict(micro_batch=1)),
    "full_phi3_zero3": ("full_phi3", dict(micro_batch=2)),
    # The LM head's copy sharded in the head unit (#31).
    "lora_llama_mts_zero3": ("lora_llama_mts", dict(micro_batch=1)),
}

# Helpers --------------------------------------------------------------------------------------


def need(test, *names):
    missing = [n for n in names if not os.access(os.path.join(BIN_DIR, n), os.X_OK)]
    if not missing:
        return
    msg = f"missing {', '.join(missing)} in {BIN_DIR}"
    if BIN_DIR_FROM_ENV:
        test.fail(msg + " (LATHE_BIN_DIR is set: build it first)")
    raise unittest.SkipTest(msg)


def run(cmd, what):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed (exit {proc.returncode}):\n  $ {' '.join(cmd)}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc.stdout


def make_records(lengths, vocab, seed):
    """Token-id records: every third without labels, every third with a -100 prompt and a few
    labels that are not the inputs, every third with every other position a target."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        record = {"input_ids": ids}
        if i % 3 == 1:
            labels = list(ids)
            prompt = length // 3
            labels[:prompt] = [-100] * prompt
            for j in torch.randint(prompt, length, (3,), generator=g).tolist():
                labels[j] = (labels[j] + 7) % vocab
            record["labels"] = labels
        elif i % 3 == 2:
            record["labels"] = [-100 if j % 2 else t for j, t in enumerate(ids)]
        records.append(record)
    return records


# docs/training.md, "Order": SplitMix64 Fisher-Yates, one permutation per epoch.
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def epoch_permutation(n, seed, epoch):
    state = (seed + _GOLDEN * (epoch + 1)) & _MASK
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        state = (state + _GOLDEN) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        z ^= z >> 31
        j = z % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def lathe_sequences(records, count, seq_len, pack, seed):
    """The first `count` training sequences (input_ids, labels) as docs/training.md,
    "Sequences" defines them."""
    docs = [(r["input_ids"], r.get("labels", r["input_ids"])) for r in records]
    out, epoch = [], 0
    if not pack:
        while len(out) < count:
            for d in epoch_permutation(len(docs), seed, epoch):
                ids, labels = docs[d]
                out.append((ids[:seq_len], labels[:seq_len]))
            epoch += 1
        return out[:count]
    stream_ids, stream_labels = [], []
    while len(stream_ids) < count * seq_len:
        for d in epoch_permutation(len(docs), seed, epoch):
            ids, labels = docs[d]
            stream_ids += ids
            stream_labels += [-100] + list(labels[1:])  # no document predicts the next's start
        epoch += 1
    return [(stream_ids[k * seq_len:(k + 1) * seq_len],
             stream_labels[k * seq_len:(k + 1) * seq_len]) for k in range(count)]


def collate(sequences):
    """Right-padded with token 0, label -100 and attention mask 0."""
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    labels = torch.full((len(sequences), width), -100, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for b, (i, l) in enumerate(sequences):
        ids[b, :len(i)] = torch.tensor(i)
        labels[b, :len(l)] = torch.tensor(l)
        mask[b, :len(i)] = 1
    return ids, labels, mask


def lora_config(job):
    lora = job["lora"]
    return LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=lora["targets"],
                      lora_dropout=0.0, use_rslora=lora["use_rslora"], init_lora_weights=False,
                      rank_pattern=lora.get("rank_pattern", {}),
                      alpha_pattern=lora.get("alpha_pattern", {}),
                      modules_to_save=lora.get("modules_to_save"),
                      bias="none", task_type="CAUSAL_LM")


def peft_name(name):
    """PEFT's parameter name (…lora_A.default.weight, …lm_head.modules_to_save.default.weight)
    as saved (…lora_A.weight, …lm_head.weight)."""
    return name.replace(".modules_to_save.default.", ".").replace(".default.", ".")


def hf_train(model, job, records, plant=None):
    """The judge: `STEPS` AdamW steps of `model` (a PeftModel or a transformers model) over
    the job's sequences. Returns a dict: `steps`, the per-step (loss, grad_norm, lr);
    `first_grads`, the first step's gradients (after clipping) by saved name; `trained`, the
    trained tensors by saved name; `lr_sum` and `amplified`, WEIGHT_TOL_OF_UPDATE's bound.

    `plant` (PlantedErrorTest) runs a plausible mistake instead: "micro_batch_mean" (the loss
    of a step as the mean of its micro-batches' mean losses: gradient accumulation without
    the whole step's normalisation), "decay_everything" (weight decay on biases and norms
    too), "data_seed" (the data order of train.seed 1), or a dict of train settings to
    replace."""
    t = dict(job["train"], **(plant if isinstance(plant, dict) else {}))
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = set(Trainer.get_decay_parameter_names(None, model))
    if plant == "decay_everything":
        decay = {n for n, _ in named}
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": t["weight_decay"]},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t["lr"], betas=(t["adam_beta1"], t["adam_beta2"]),
                            eps=t["adam_eps"], foreach=False)
    sched = get_scheduler(t["schedule"]["kind"], opt,
                          num_warmup_steps=t["schedule"]["warmup_steps"],
                          num_training_steps=STEPS)
    g = t["global_batch"]
    sequences = lathe_sequences(records, STEPS * g, SEQ_LEN, job["pack"],
                                seed=1 if plant == "data_seed" else 0)
    steps, first_grads = [], None
    # WEIGHT_TOL_OF_UPDATE's error model: per element, the sum over the steps of lr_k times
    # 2 GRAD_REL_TOL G / (sqrt(v_hat_k) + eps), G the tensor's largest gradient element so far.
    amplified = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named}
    largest = {n: 0.0 for n, _ in named}
    lr_sum = 0.0
    beta2, eps = t["adam_beta2"], t["adam_eps"]
    for k in range(STEPS):
        batch = sequences[k * g:(k + 1) * g]
        if plant == "micro_batch_mean":
            m = t["micro_batch"]
            losses = [model(**dict(zip(("input_ids", "labels", "attention_mask"),
                                       collate(batch[i:i + m])))).loss for i in range(0, g, m)]
            loss = sum(losses) / len(losses)
        else:
            ids, labels, mask = collate(batch)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        params = [p for _, p in named]
        if t["max_grad_norm"] > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, t["max_grad_norm"])
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        lr = sched.get_last_lr()[0]
        if k == 0:
            first_grads = {peft_name(n): p.grad.detach().clone() for n, p in named}
        for n, p in named:
            largest[n] = max(largest[n], p.grad.abs().max().item())
        opt.step()
        lr_sum += lr
        for n, p in named:
            v_hat = opt.state[p]["exp_avg_sq"].double() / (1 - beta2 ** (k + 1))
            amplified[n] += lr * 2 * GRAD_REL_TOL * largest[n] / (v_hat.sqrt() + eps)
        sched.step()
        opt.zero_grad(set_to_none=True)
        steps.append((loss.item(), norm.item(), lr))
    trained = {peft_name(n): p.detach().clone() for n, p in named}
    return dict(steps=steps, first_grads=first_grads, trained=trained, lr_sum=lr_sum,
                amplified={peft_name(n): a for n, a in amplified.items()})


def job_spec(job, model_dir, data, output, init_from=None, ranks=1, **train_changes):
    t = dict(job["train"], **train_changes)
    spec = {"name": "hf-training", "model": {"path": model_dir},
            "data": {"train": data, "seq_len": SEQ_LEN, "pack": job["pack"]},
            "method": job["method"],
            "train": dict(t, steps=STEPS, optimizer="adamw", precision="fp32", seed=0),
            "resources": {"ranks": ranks, "device": "cpu"},
            "output": output}
    if job["method"] != "full":
        lora = job["lora"]
        spec["lora"] = {"rank": lora["rank"], "alpha": lora["alpha"], "dropout": 0.0,
                        "targets": lora["targets"], "use_rslora": lora["use_rslora"],
                        "init_from": init_from}
        for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
            if key in lora:
                spec["lora"][key] = lora[key]
        if job.get("spec_default_targets"):
            del spec["lora"]["targets"]
    if ranks > 1:
        spec["strategy"] = {"zero_stage": 3}
    else:
        # The first step's checkpoint holds exp_avg = (1 - beta1) * gradient.
        spec["train"].update(checkpoint_every=1, keep_checkpoints=STEPS)
    return spec


def lathe_train(spec, path, ranks=1):
    """Runs the spec (on `ranks` processes); returns (steps, done, plan) of rank 0."""
    with open(path, "w") as f:
        json.dump(spec, f, indent=2)
    cmd = [os.path.join(BIN_DIR, "lathe-worker"), "train", "--spec", path, "--output", "json",
           "--threads", "1", "--peak-flops", "1e12"]
    if ranks == 1:
        events = [trainer_events.read_events(run(cmd, "lathe-worker train"))]
    else:
        rendezvous = os.path.join(os.path.dirname(path), "rendezvous-" + os.path.basename(path))
        procs = [subprocess.Popen(cmd + ["--rank", str(r), "--world-size", str(ranks),
                                         "--rendezvous-dir", rendezvous,
                                         "--collective-timeout", "60"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(ranks)]
        events = []
        try:
            for r, proc in enumerate(procs):
                out, err = proc.communicate(timeout=300)
                if proc.returncode != 0:
                    raise AssertionError(f"lathe-worker train rank {r} failed (exit "
                                         f"{proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
                events.append(trainer_events.read_events(out))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    first = events[0]
    steps = [e for e in first if e["event"] == "step"]
    done = [e for e in first if e["event"] == "done"]
    start = [e for e in first if e["event"] == "start"]
    if len(done) != 1 or len(start) != 1:
        raise AssertionError(f"lathe-worker train: expected one start and one done event: {first}")
    return steps, done[0], start[0]["plan"]


def lathe_score(model_dir, adapter, data, logits_out):
    """`lathe-worker score`'s logits per record and its JSON (loss, targets)."""
    cmd = [os.path.join(BIN_DIR, "lathe-worker"), "score", "--model", model_dir, "--data", data,
           "--logits-out", logits_out, "--output", "json", "--threads", "1"]
    if adapter:
        cmd += ["--adapter", adapter]
    lines = [l for l in run(cmd, "lathe-worker score").splitlines() if l.startswith("{")]
    tensors = load_file(logits_out)
    return [tensors[f"logits.{i}"] for i in range(len(tensors))], json.loads(lines[-1])


# PEFT's warning for modules_to_save on a tied model without ensure_weight_tying: what it
# does then (each copy replaces one use of the tied weight) is what Lathe does.
TIED_MODULES_WARNING = "Model has `tie_word_embeddings=True` and a tied layer is part of the adapter"


def load_peft_strictly(test, base, adapter_dir):
    """PeftModel.from_pretrained(base, adapter_dir), checking that every key matched: no
    warning from from_pretrained (but TIED_MODULES_WARNING), load_adapter's load_result
    without missing or unexpected keys, and PEFT's adapter state dict exactly the file's
    tensors (names and values)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, adapter_dir)
    # Any warning of PEFT's own, or naming keys (missing, unexpected, mismatched).
    adapter_warnings = [str(w.message) for w in caught
                        if (f"{os.sep}peft{os.sep}" in w.filename or "keys" in str(w.message))
                        and not str(w.message).startswith(TIED_MODULES_WARNING)]
    test.assertEqual(adapter_warnings, [], f"{adapter_dir}: PEFT warned while loading")
    # load_adapter returns what set_peft_model_state_dict's load_state_dict reported.
    result = model.load_adapter(adapter_dir, adapter_name="strict_check")
    test.assertEqual(list(result.missing_keys), [], f"{adapter_dir}: missing keys")
    test.assertEqual(list(result.unexpected_keys), [], f"{adapter_dir}: unexpected keys")
    model.delete_adapter("strict_check")
    model.set_adapter("default")
    stored = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(model, adapter_name="default")
    test.assertEqual(sorted(loaded), sorted(stored), f"{adapter_dir}: PEFT's keys")
    for name, tensor in stored.items():
        test.assertTrue(torch.equal(loaded[name], tensor), f"{adapter_dir}: {name} changed")
    return model.eval()


def normwise(a, b):
    """max|a - b| / max|b| in float64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def nf4_dequantized_copy(model_dir, out_dir, tmp):
    """A copy of `model_dir` whose projections of every layer (seven, or Phi-3's four) are
    Lathe's NF4 round trip of them (lathe-nf4-quantize's .dequantized), the values method
    qlora computes with."""
    shutil.copytree(model_dir, out_dir)
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    projections = {n: w for n, w in weights.items()
                   if n.endswith(".weight") and n.split(".")[-2] in ALL_TARGETS + PHI3_TARGETS}
    src, dst = os.path.join(tmp, "nf4-in.safetensors"), os.path.join(tmp, "nf4-out.safetensors")
    save_file(projections, src)
    run([os.path.join(BIN_DIR, "lathe-nf4-quantize"), "--in", src, "--out", dst],
        "lathe-nf4-quantize")
    q = load_file(dst)
    for name in projections:
        weights[name] = q[name + ".dequantized"].contiguous()
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


# Prepared models, jobs and runs (each once per process) ----------------------------------------

_TMP = None
_CACHE = {}


def tmp_dir():
    global _TMP
    if _TMP is None:
        _TMP = tempfile.mkdtemp(prefix="lathe-hf-train-")
    return _TMP


def tearDownModule():
    if _TMP is not None:
        shutil.rmtree(_TMP, ignore_errors=True)


def cached(key, make):
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


class Base:
    """A model of MODELS saved with save_pretrained, its data, eval data."""

    def __init__(self, name):
        self.name = name
        self.case = MODELS[name]
        self.dir = os.path.join(tmp_dir(), name)
        model = arch.build_model(self.case)
        model.save_pretrained(os.path.join(self.dir, "model"), safe_serialization=True)
        self.model_dir = os.path.join(self.dir, "model")
        vocab = self.case["config"]["vocab_size"]
        self.records = make_records(TRAIN_LENGTHS, vocab, self.case["seed"] + 100)
        self.train = arch.write_records(os.path.join(self.dir, "train.jsonl"), self.records)
        self.eval_records = make_records(EVAL_LENGTHS, vocab, self.case["seed"] + 200)
        self.eval = arch.write_records(os.path.join(self.dir, "eval.jsonl"), self.eval_records)

    def load(self, model_dir=None):
        """A fresh float32 copy of the base, from its saved directory (or `model_dir`)."""
        return AutoModelForCausalLM.from_pretrained(model_dir or self.model_dir,
                                                    dtype=torch.float32)

    def init_adapter(self, job_name, job):
        """The PEFT adapter the job starts from, made and saved by PEFT."""
        path = os.path.join(self.dir, f"init-{job_name}")
        if not os.path.isdir(path):
            torch.manual_seed(self.case["seed"] + 7)
            get_peft_model(self.load(), lora_config(job)).save_pretrained(path)
        return path


def base(name):
    return cached(("base", name), lambda: Base(name))


def base_dir_of(job_name):
    """The job's HF-side base directory: the model's, or for qlora its NF4-dequantized copy."""
    job = JOBS[job_name]
    b = base(job["model"])
    if job["method"] != "qlora":
        return b.model_dir
    return cached(("nf4", job["model"]), lambda: nf4_dequantized_copy(
        b.model_dir, os.path.join(b.dir, "model-nf4"), b.dir))


def hf_result(job_name):
    """hf_train's result for a job of JOBS, from the job's starting weights."""
    def make():
        job = JOBS[job_name]
        b = base(job["model"])
        model = b.load(base_dir_of(job_name))
        if job["method"] != "full":
            model = PeftModel.from_pretrained(model, b.init_adapter(job_name, job),
                                              is_trainable=True)
        return hf_train(model, job, b.records)
    return cached(("hf", job_name), make)


def lathe_result(job_name):
    """Lathe's run of a job (JOBS or ZERO3_JOBS): steps, done, plan, the trained tensors
    (adapter or model), and the first step's gradients (single-process runs)."""
    def make():
        if job_name in ZERO3_JOBS:
            parent, changes = ZERO3_JOBS[job_name]
            ranks = 2
        else:
            parent, changes, ranks = job_name, {}, 1
        job = JOBS[parent]
        b = base(job["model"])
        out = os.path.join(b.dir, f"out-{job_name}")
        init = b.init_adapter(parent, job) if job["method"] != "full" else None
        spec = job_spec(job, b.model_dir, b.train, out, init, ranks, **changes)
        steps, done, plan = lathe_train(spec, os.path.join(b.dir, f"{job_name}.json"), ranks)
        if job["method"] == "full":
            # Read by transformers, every tensor accounted for.
            model, info = AutoModelForCausalLM.from_pretrained(
                done["model"], dtype=torch.float32, output_loading_info=True)
            loading = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
            if loading or info.get("error_msgs"):
                raise AssertionError(f"{done['model']}: from_pretrained: {info}")
            trained = {n: p.detach() for n, p in model.named_parameters()}
        else:
            trained = load_file(os.path.join(done["adapter"], "adapter_model.safetensors"))
        grads = None
        if ranks == 1:
            state = load_file(os.path.join(out, "checkpoints", "step-00000001",
                                           "optimizer.safetensors"))
            beta1 = job["train"]["adam_beta1"]
            grads = {n[len("exp_avg."):]: m / (1 - beta1) for n, m in state.items()
                     if n.startswith("exp_avg.")}
        return dict(steps=steps, done=done, plan=plan, trained=trained, grads=grads, job=job,
                    parent=parent, spec=spec)
    return cached(("lathe", job_name), make)


# The tests --------------------------------------------------------------------------------------


def compare_training(lathe, hf):
    """Lathe's run against an HF loop's result: the measures TrainingCase holds to the
    tolerances (and PlantedErrorTest expects a planted mistake to exceed)."""
    m = {"report": []}
    loss_errs, norm_errs = [], []
    for k, (step, (loss, norm, lr)) in enumerate(zip(lathe["steps"], hf["steps"])):
        loss_errs.append(abs(step["loss"] - loss) / abs(loss))
        norm_errs.append(abs(step["grad_norm"] - norm) / norm)
        m["report"].append(f"{k + 1}: loss {step['loss']:.7f} hf {loss:.7f} "
                           f"({loss_errs[-1]:.1e}), grad_norm {step['grad_norm']:.6f} hf "
                           f"{norm:.6f} ({norm_errs[-1]:.1e}), lr {step['lr']:.4e} hf {lr:.4e}")
    m["loss_errs"], m["norm_errs"] = loss_errs, norm_errs
    m["lr_errs"] = [abs(s["lr"] - h[2]) / h[2] if h[2] else abs(s["lr"])
                    for s, h in zip(lathe["steps"], hf["steps"])]
    if lathe["grads"] is not None:
        m["grad"] = max((normwise(lathe["grads"][n], hf["first_grads"][n]), n)
                        for n in hf["first_grads"])
    # The trained tensors, element by element (WEIGHT_TOL_OF_UPDATE).
    unit = hf["lr_sum"]
    worst, plain_worst = (0.0, None, 0.0, 0.0), 0.0
    for name, want in hf["trained"].items():
        bound = (unit * WEIGHT_TOL_OF_UPDATE + hf["amplified"][name]).flatten()
        err = (lathe["trained"][name].double() - want.double()).abs().flatten()
        ratio = err / bound
        i = ratio.argmax()
        if ratio[i] > worst[0]:
            worst = (ratio[i].item(), name, err[i].item() / unit, bound[i].item() / unit)
        plain = err[bound <= 2 * unit * WEIGHT_TOL_OF_UPDATE]
        if plain.numel():
            plain_worst = max(plain_worst, plain.max().item() / unit)
    m["trained"], m["plain_trained"] = worst, plain_worst
    return m


class TrainingCase(unittest.TestCase):
    BINARIES = ("lathe-worker",)

    def setUp(self):
        need(self, *self.BINARIES)

    def check_job(self, job_name, lathe):
        """Lathe's run of `job_name` against the HF loop of its job, within the tolerances."""
        job = JOBS[lathe["parent"]]
        hf = hf_result(lathe["parent"])
        self.assertEqual(len(lathe["steps"]), STEPS, job_name)
        self.assertFalse(any(s["skipped"] for s in lathe["steps"]), job_name)
        self.assertEqual(sorted(lathe["trained"]), sorted(hf["trained"]), f"{job_name}: names")
        if lathe["grads"] is not None:
            self.assertEqual(sorted(lathe["grads"]), sorted(hf["first_grads"]), job_name)
        m = compare_training(lathe, hf)
        table = "\n".join(m["report"])
        for k in range(STEPS):
            self.assertLessEqual(m["loss_errs"][k], STEP_LOSS_REL_TOL,
                                 f"{job_name}: step {k + 1}'s loss\n{table}")
            self.assertLessEqual(m["norm_errs"][k],
                                 GRAD_NORM_REL_TOL if k == 0 else LATER_GRAD_NORM_REL_TOL,
                                 f"{job_name}: step {k + 1}'s grad_norm\n{table}")
            self.assertLessEqual(m["lr_errs"][k], 1e-12, f"{job_name}: step {k + 1}'s lr\n{table}")
        if "grad" in m:
            self.assertLessEqual(m["grad"][0], GRAD_REL_TOL,
                                 f"{job_name}: the first step's gradient of {m['grad'][1]}: "
                                 f"max|lathe - hf| / max|hf| = {m['grad'][0]:.3e}")
        ratio, name, err, bound = m["trained"]
        self.assertLessEqual(ratio, 1.0, f"{job_name}: {name} after {STEPS} steps: an element "
                             f"differs by {err:.3e} of the summed learning rate, its bound is "
                             f"{bound:.3e}")
        # Training moved the tensors far beyond the floor: the comparison checks the updates.
        b = base(job["model"])
        if job["method"] == "full":
            initial = {n: p.detach() for n, p in b.load().named_parameters()}
        else:
            initial = load_file(os.path.join(b.init_adapter(lathe["parent"], job),
                                             "adapter_model.safetensors"))
        moved = max((hf["trained"][n] - initial[n]).abs().max().item() for n in initial)
        self.assertGreater(moved, 100 * WEIGHT_TOL_OF_UPDATE * hf["lr_sum"],
                           f"{job_name}: training hardly moved the tensors")
        print(f"\n{job_name}: micro-batch {lathe['plan'].get('micro_batch')} x "
              f"{lathe['plan'].get('gradient_accumulation')} on {lathe['plan'].get('ranks')} "
              f"rank(s); step losses within {max(m['loss_errs']):.1e}, grad_norm "
              f"{max(m['norm_errs']):.1e}; "
              + (f"first-step gradients {m['grad'][0]:.1e} ({m['grad'][1]}); " if "grad" in m
                 else "")
              + f"trained: worst element at {ratio:.2e} of its bound ({name}: {err:.2e} of "
              f"sum(lr), bound {bound:.2e}), well-conditioned elements within "
              f"{m['plain_trained']:.2e} sum(lr)\n  " + "\n  ".join(m["report"]),
              file=sys.stderr)
        return m


class LoraTrainingTest(TrainingCase):
    """LoRA from a PEFT adapter, against PEFT's LoRA in the HF loop."""

    def test_lora_llama(self):
        lathe = lathe_result("lora_llama")
        self.assertEqual((lathe["plan"]["strategy"]["micro_batch"], lathe["plan"]["gradient_accumulation"]),
                         ("2", "2"))
        self.check_job("lora_llama", lathe)

    def test_lora_qwen2_packed_rslora(self):
        lathe = lathe_result("lora_qwen2")
        self.assertEqual(lathe["plan"]["gradient_accumulation"], "4")
        self.check_job("lora_qwen2", lathe)

    def test_lora_qwen3(self):
        self.check_job("lora_qwen3", lathe_result("lora_qwen3"))

    def test_lora_llama_regex_targets(self):
        lathe = lathe_result("lora_llama_regex")
        # Only the matched projections carry adapters, v_proj's of rank 2.
        self.assertEqual(sorted({n.split(".lora_")[0].replace("base_model.model.model.", "")
                                 for n in lathe["trained"]}),
                         ["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj",
                          "layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"])
        for name, tensor in lathe["trained"].items():
            rank = 2 if ".v_proj." in name else 4
            self.assertEqual(tensor.shape[0 if ".lora_A." in name else 1], rank, name)
        self.check_job("lora_llama_regex", lathe)
    def test_lora_gemma2(self):
        self.check_job("lora_gemma2", lathe_result("lora_gemma2"))

    def test_lora_phi3_default_targets(self):
        self.check_job("lora_phi3", lathe_result("lora_phi3"))

    def test_lora_llama_modules_to_save(self):
        # The LM head's copy trains beside the adapters (its first gradient and trained values
        # held like theirs); the base's lm_head stays as it was.
        lathe = lathe_result("lora_llama_mts")
        self.assertIn("base_model.model.lm_head.weight", lathe["trained"])
        self.check_job("lora_llama_mts", lathe)

    def test_lora_qwen2_tied_modules_to_save(self):
        # Both copies of the one tied weight, trained apart, each from its own use's gradient.
        lathe = lathe_result("lora_qwen2_mts")
        embed = lathe["trained"]["base_model.model.model.embed_tokens.weight"]
        head = lathe["trained"]["base_model.model.lm_head.weight"]
        self.assertFalse(torch.equal(embed, head))
        self.check_job("lora_qwen2_mts", lathe)


class FullTrainingTest(TrainingCase):
    """method full against the bare transformers model in the HF loop; the exported model
    read back with from_pretrained."""

    def test_full_qwen2_tied(self):
        lathe = lathe_result("full_qwen2")
        config = arch.read_config(lathe["done"]["model"])
        self.assertTrue(config["tie_word_embeddings"])
        self.check_job("full_qwen2", lathe)

    def test_full_qwen3(self):
        lathe = lathe_result("full_qwen3")
        self.assertIn("model.layers.1.self_attn.k_norm.weight", lathe["trained"])
        self.check_job("full_qwen3", lathe)

    def test_full_gemma2(self):
        lathe = lathe_result("full_gemma2")
        self.assertIn("model.layers.1.post_feedforward_layernorm.weight", lathe["trained"])
        self.check_job("full_gemma2", lathe)

    def test_full_phi3(self):
        lathe = lathe_result("full_phi3")
        self.assertIn("model.layers.1.self_attn.qkv_proj.weight", lathe["trained"])
        self.assertIn("model.layers.1.mlp.gate_up_proj.weight", lathe["trained"])
        self.check_job("full_phi3", lathe)


class QLoraTrainingTest(TrainingCase):
    """method qlora against PEFT's LoRA over the NF4-dequantized base."""
    BINARIES = ("lathe-worker", "lathe-nf4-quantize")

    def test_qlora_llama(self):
        lathe = lathe_result("qlora_llama")
        self.check_job("qlora_llama", lathe)
        # Without the quantization (PEFT over the unquantized base) the first loss is far off:
        # the comparison above does see the 4-bit base.
        plain_first = hf_result("lora_llama")["steps"][0][0]
        gap = abs(plain_first - lathe["steps"][0]["loss"]) / abs(plain_first)
        self.assertGreater(gap, 10 * STEP_LOSS_REL_TOL, "the NF4 base hardly moves the loss")

    def test_qlora_qwen3(self):
        self.check_job("qlora_qwen3", lathe_result("qlora_qwen3"))

    def test_qlora_gemma2(self):
        self.check_job("qlora_gemma2", lathe_result("qlora_gemma2"))
    def test_qlora_phi3(self):
        self.check_job("qlora_phi3", lathe_result("qlora_phi3"))


class Zero3TrainingTest(TrainingCase):
    """ZeRO-3 on 2 ranks (two processes meeting in a rendezvous directory) against the same
    HF loops: the same steps and tolerances as one process."""

    def test_lora_llama_two_ranks(self):
        lathe = lathe_result("lora_llama_zero3")
        self.assertEqual((lathe["plan"]["ranks"], lathe["plan"]["strategy"]["zero_stage"]), ("2", "3"))
        self.check_job("lora_llama_zero3", lathe)

    def test_full_qwen2_two_ranks(self):
        lathe = lathe_result("full_qwen2_zero3")
        self.assertEqual((lathe["plan"]["ranks"], lathe["plan"]["strategy"]["zero_stage"]), ("2", "3"))
        self.check_job("full_qwen2_zero3", lathe)

    def test_lora_qwen3_two_ranks(self):
        lathe = lathe_result("lora_qwen3_zero3")
        self.assertEqual((lathe["plan"]["ranks"], lathe["plan"]["strategy"]["zero_stage"]), ("2", "3"))
        self.check_job("lora_qwen3_zero3", lathe)

    def test_full_qwen3_two_ranks(self):
        lathe = lathe_result("full_qwen3_zero3")
        self.assertEqual((lathe["plan"]["ranks"], lathe["plan"]["strategy"]["zero_stage"]), ("2", "3"))
        self.check_job("full_qwen3_zero3", lathe)

    def test_lora_llama_regex_two_ranks(self):
        lathe = lathe_result("lora_llama_regex_zero3")
        self.assertEqual((lathe["plan"]["ranks"], lathe["plan"]["strategy"]["zero_stage"]), ("2", "3"))
        self.check_job("lora_llama_regex_zero3", lathe)
    def test_full_gemma2_two_ranks(self):
        lathe = lathe_result("full_gemma2_zero3")
        self.assertEqual((lathe["plan"]["ranks"], lathe["plan"]["strategy"]["zero_stage"]), ("2", "3"))
        self.check_job("full_gemma2_zero3", lathe)

    def test_lora_llama_modules_to_save_two_ranks(self):
        lathe = lathe_result("lora_llama_mts_zero3")
        self.assertEqual((lathe["plan"]["ranks"], lathe["plan"]["strategy"]["zero_stage"]), ("2", "3"))
        self.check_job("lora_llama_mts_zero3", lathe)

    def test_phi3_two_ranks(self):
        for job_name in ("lora_phi3_zero3", "full_phi3_zero3"):
            with self.subTest(job=job_name):
                lathe = lathe_result(job_name)
                self.assertEqual(
                    (lathe["plan"]["ranks"], lathe["plan"]["strategy"]["zero_stage"]), ("2", "3"))
                self.check_job(job_name, lathe)


class PlantedErrorTest(TrainingCase):
    """The comparisons catch plausible mistakes: Lathe's runs held against an HF loop that
    makes one (hf_train's `plant`), each must fail the check it concerns. Measured margins
    (how many times the tolerance the planted loop misses by) in each test."""

    def planted(self, job_name, plant=None, lora_scale=None):
        job = JOBS[job_name]
        b = base(job["model"])
        model = b.load(base_dir_of(job_name))
        if job["method"] != "full":
            model = PeftModel.from_pretrained(model, b.init_adapter(job_name, job),
                                              is_trainable=True)
            if lora_scale is not None:
                scalings = [getattr(m, "scaling", None) for m in model.modules()]
                layers = [x for x in scalings if isinstance(x, dict) and "default" in x]
                self.assertTrue(layers)
                for scaling in layers:
                    scaling["default"] *= lora_scale
        return compare_training(lathe_result(job_name), hf_train(model, job, b.records, plant))

    def assert_gradient_caught(self, m, what):
        self.assertGreater(m["grad"][0], 10 * GRAD_REL_TOL,
                           f"{what}: first-step gradients only {m['grad'][0]:.2e} apart")

    def assert_update_caught(self, m, what):
        self.assertGreater(m["trained"][0], 1.0,
                           f"{what}: trained tensors within {m['trained'][0]:.2f} of the bound")

    def test_loss_averaged_per_micro_batch(self):
        # Accumulation that averages each micro-batch's mean loss (instead of dividing the
        # step's summed loss by its target count): gradients 0.67 (normwise) apart on
        # lora_llama, 0.36 on lora_qwen2.
        for job_name in ("lora_llama", "lora_qwen2"):
            with self.subTest(job=job_name):
                self.assert_gradient_caught(self.planted(job_name, "micro_batch_mean"),
                                            job_name)

    def test_lora_scaling_one_percent_off(self):
        # alpha / r (here 2) as 2.02: gradients 7.8e-2 apart.
        self.assert_gradient_caught(self.planted("lora_llama", lora_scale=1.01), "scaling")

    def test_data_order(self):
        # The sequences of train.seed 1 instead of 0: gradients 1.5 apart.
        m = self.planted("lora_llama", "data_seed")
        self.assert_gradient_caught(m, "data order")
        self.assertGreater(m["loss_errs"][0], 10 * STEP_LOSS_REL_TOL)

    def test_weight_decay_on_biases_and_norms(self):
        # transformers' Trainer (and Lathe) exempt them: decaying them too misses by 57x.
        self.assert_update_caught(self.planted("full_qwen2", "decay_everything"), "decay")

    def test_adam_settings(self):
        # beta2 0.999 for 0.99: 2.5x the bound; eps 1e-8 for 1e-7: 4.9x; beta1 0.9 for 0.85:
        # 37x. (Their first-step gradients are the same: only the update differs.)
        for change in ({"adam_beta2": 0.999}, {"adam_eps": 1e-8}, {"adam_beta1": 0.9}):
            with self.subTest(change=change):
                self.assert_update_caught(self.planted("lora_llama", change), str(change))


class AdapterRoundTripTest(TrainingCase):
    """Lathe's adapters in PEFT, PEFT's adapters in Lathe: loaded with every key, the same
    loss and logits on the eval data."""

    def compare_scores(self, peft_model, base_dir, adapter_dir, b, what):
        out = os.path.join(b.dir, f"logits-{len(_CACHE)}-{os.path.basename(adapter_dir)}"
                           f"-{os.path.basename(base_dir)}.safetensors")
        lathe_logits, lathe = lathe_score(base_dir, adapter_dir, b.eval, out)
        hf_logits, hf_loss, hf_targets = arch.hf_score(peft_model, b.eval_records)
        self.assertEqual(lathe["targets"], hf_targets, f"{what}: target count")
        loss_err = abs(lathe["loss"] - hf_loss) / abs(hf_loss)
        self.assertLessEqual(loss_err, SCORE_LOSS_REL_TOL,
                             f"{what}: lathe score {lathe['loss']!r} vs PEFT {hf_loss!r}: "
                             f"relative {loss_err:.3e}")
        logit_err, record = arch.max_rel_error(lathe_logits, hf_logits)
        self.assertLessEqual(logit_err, LOGIT_REL_TOL, f"{what}: logits (record {record}): "
                             f"{logit_err:.3e}")
        print(f"\n{what}: loss {hf_loss:.6f}, relative error {loss_err:.1e}, logits "
              f"{logit_err:.1e}", file=sys.stderr)
        return hf_loss

    def check_lathe_adapter(self, job_name, bases=None):
        lathe = lathe_result(job_name)
        job = JOBS[lathe["parent"]]
        b = base(job["model"])
        adapter = lathe["done"]["adapter"]
        losses = []
        for base_dir in bases or [b.model_dir]:
            with self.subTest(job=job_name, base=os.path.basename(base_dir)):
                model = load_peft_strictly(self, b.load(base_dir), adapter)
                config = model.peft_config["default"]
                self.assertEqual((config.r, config.lora_alpha, config.use_rslora,
                                  sorted(config.target_modules), config.rank_pattern,
                                  config.alpha_pattern, config.modules_to_save),
                                 (job["lora"]["rank"], job["lora"]["alpha"],
                                  job["lora"]["use_rslora"], sorted(job["lora"]["targets"]),
                                  job["lora"].get("rank_pattern", {}),
                                  job["lora"].get("alpha_pattern", {}),
                                  job["lora"].get("modules_to_save")))
                losses.append(self.compare_scores(model, base_dir, adapter, b,
                                                  f"{job_name} on {os.path.basename(base_dir)}"))
        return losses

    def test_lathe_lora_adapters_load_in_peft(self):
        self.check_lathe_adapter("lora_llama")
        self.check_lathe_adapter("lora_qwen2")
        # Phi-3: the spec named no targets; the adapter says the four fused projections, with
        # qkv_proj's B of (heads + 2 kv_heads) x head_dim rows, and PEFT loads every key.
        self.check_lathe_adapter("lora_phi3")
        config = MODELS["phi3"]["config"]
        adapter = load_file(os.path.join(lathe_result("lora_phi3")["done"]["adapter"],
                                         "adapter_model.safetensors"))
        self.assertEqual(
            tuple(adapter["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"].shape),
            ((config["num_attention_heads"] + 2 * config["num_key_value_heads"])
             * config["hidden_size"] // config["num_attention_heads"], 8))

    def test_lathe_regex_target_adapter_loads_in_peft(self):
        # target_modules is the regular expression, a string, as PEFT saves it; the rank and
        # alpha patterns as given.
        self.check_lathe_adapter("lora_llama_regex")
        with open(os.path.join(lathe_result("lora_llama_regex")["done"]["adapter"],
                               "adapter_config.json")) as f:
            self.assertEqual(json.load(f)["target_modules"],
                             JOBS["lora_llama_regex"]["lora"]["targets"])

    def test_lathe_zero3_adapter_loads_in_peft(self):
        self.check_lathe_adapter("lora_llama_zero3")

    def test_lathe_modules_to_save_adapters_load_in_peft(self):
        # PEFT reads the copies under its keys into its ModulesToSaveWrapper (every key
        # matched), and its forward with them scores as `lathe-worker score --adapter` does:
        # untied, single process and ZeRO-3, and on the tied Qwen2 (each copy one use).
        for job_name in ("lora_llama_mts", "lora_llama_mts_zero3", "lora_qwen2_mts"):
            self.check_lathe_adapter(job_name)
        # The copy matters: the same adapters with the base's LM head score otherwise.
        lathe = lathe_result("lora_llama_mts")
        b = base("llama")
        tensors = load_file(os.path.join(lathe["done"]["adapter"], "adapter_model.safetensors"))
        path = os.path.join(b.dir, "mts-without-head")
        shutil.copytree(lathe["done"]["adapter"], path, dirs_exist_ok=True)
        save_file({k: v for k, v in tensors.items() if k != "base_model.model.lm_head.weight"},
                  os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        config["modules_to_save"] = None
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        _, without = lathe_score(b.model_dir, path, b.eval, os.path.join(b.dir, "mts-wo.st"))
        _, with_head = lathe_score(b.model_dir, lathe["done"]["adapter"], b.eval,
                                   os.path.join(b.dir, "mts-w.st"))
        self.assertGreater(abs(without["loss"] - with_head["loss"]) / with_head["loss"],
                           100 * SCORE_LOSS_REL_TOL)

    def test_lathe_qlora_adapter_loads_in_peft(self):
        need(self, "lathe-nf4-quantize")
        # On the unquantized base (where the exported adapter is meant to be used) and on the
        # dequantized one it was trained over.
        b = base("llama")
        plain, nf4 = self.check_lathe_adapter("qlora_llama",
                                              [b.model_dir, base_dir_of("qlora_llama")])
        self.assertGreater(abs(plain - nf4) / plain, 10 * SCORE_LOSS_REL_TOL)

    def test_strict_loading_catches_missing_and_unexpected_keys(self):
        # load_peft_strictly is not vacuous: the Lathe adapter less one tensor, or with one
        # more (a tensor no module has), is refused.
        lathe = lathe_result("lora_llama")
        b = base("llama")
        tensors = load_file(os.path.join(lathe["done"]["adapter"], "adapter_model.safetensors"))
        name = sorted(tensors)[0]
        extra = name.replace("lora_A", "lora_C")
        for what, edited in (("missing", {k: v for k, v in tensors.items() if k != name}),
                             ("unexpected", dict(tensors, **{extra: tensors[name].clone()}))):
            with self.subTest(what):
                path = os.path.join(b.dir, f"edited-{what}")
                shutil.copytree(lathe["done"]["adapter"], path, dirs_exist_ok=True)
                save_file(edited, os.path.join(path, "adapter_model.safetensors"),
                          metadata={"format": "pt"})
                with self.assertRaises(AssertionError):
                    load_peft_strictly(self, b.load(), path)

    def check_peft_adapter(self, b, adapter_dir, what):
        model = load_peft_strictly(self, b.load(), adapter_dir)
        return self.compare_scores(model, b.model_dir, adapter_dir, b, what)

    def test_peft_random_adapter_scores_in_lathe(self):
        # init_lora_weights=False: A and B random, on every projection of the Llama.
        b = base("llama")
        path = b.init_adapter("lora_llama", JOBS["lora_llama"])
        with_adapter = self.check_peft_adapter(b, path, "PEFT random adapter (llama)")
        # The adapter matters: the base alone scores otherwise.
        _, plain = lathe_score(b.model_dir, None, b.eval, os.path.join(b.dir, "plain.st"))
        self.assertGreater(abs(plain["loss"] - with_adapter) / with_adapter,
                           100 * SCORE_LOSS_REL_TOL)

    def test_peft_trained_adapter_scores_in_lathe(self):
        # The HF loop's LoRA after 5 steps (Qwen2, rsLoRA, 4 of the 7 targets), saved by PEFT.
        job = JOBS["lora_qwen2"]
        b = base("qwen2")
        path = os.path.join(b.dir, "peft-trained")
        if not os.path.isdir(path):
            model = PeftModel.from_pretrained(b.load(), b.init_adapter("lora_qwen2", job),
                                              is_trainable=True)
            hf_train(model, job, b.records)
            model.save_pretrained(path)
        self.check_peft_adapter(b, path, "PEFT trained adapter (qwen2, rslora)")

    def test_lathe_modules_to_save_adapter_merges_as_peft(self):
        # `lathe-worker merge` writes the trained lm_head copy as the merged model's lm_head:
        # transformers' model from it computes PEFT's base + adapter (merge_and_unload's
        # logits). A tied model's copies would need untied weights: refused.
        lathe = lathe_result("lora_llama_mts")
        b = base("llama")
        adapter = lathe["done"]["adapter"]
        out = os.path.join(b.dir, "merged-mts")
        shutil.rmtree(out, ignore_errors=True)
        run([os.path.join(BIN_DIR, "lathe-worker"), "merge", "--model", b.model_dir, "--adapter",
             adapter, "--out", out], "lathe-worker merge")
        merged, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                            output_loading_info=True)
        self.assertEqual({k: v for k, v in info.items() if v}, {}, "keys not matched")
        trained = load_file(os.path.join(adapter, "adapter_model.safetensors"))
        self.assertTrue(torch.equal(merged.lm_head.weight.detach(),
                                    trained["base_model.model.lm_head.weight"]))
        peft = load_peft_strictly(self, b.load(), adapter).merge_and_unload()
        merged_logits, merged_loss, _ = arch.hf_score(merged.eval(), b.eval_records)
        peft_logits, peft_loss, _ = arch.hf_score(peft.eval(), b.eval_records)
        logit_err, record = arch.max_rel_error(merged_logits, peft_logits)
        self.assertLessEqual(logit_err, LOGIT_REL_TOL, f"merged logits (record {record})")
        self.assertLessEqual(abs(merged_loss - peft_loss) / peft_loss, SCORE_LOSS_REL_TOL)
        tied = lathe_result("lora_qwen2_mts")["done"]["adapter"]
        proc = subprocess.run([os.path.join(BIN_DIR, "lathe-worker"), "merge", "--model",
                               base("qwen2").model_dir, "--adapter", tied, "--out",
                               os.path.join(b.dir, "merged-mts-tied")],
                              capture_output=True, text=True)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("untied embed_tokens and lm_head", proc.stderr)

    def test_peft_modules_to_save_adapter_scores_in_lathe(self):
        # The HF loop's tied Qwen2 job with both copies, saved by PEFT: `lathe-worker score
        # --adapter` reads the copies (each for its own use) and scores as PeftModel does.
        job = JOBS["lora_qwen2_mts"]
        b = base("qwen2")
        path = os.path.join(b.dir, "peft-trained-mts")
        if not os.path.isdir(path):
            model = PeftModel.from_pretrained(b.load(), b.init_adapter("lora_qwen2_mts", job),
                                              is_trainable=True)
            hf_train(model, job, b.records)
            model.save_pretrained(path)
        self.check_peft_adapter(b, path, "PEFT trained adapter with modules_to_save (tied qwen2)")


if __name__ == "__main__":
    unittest.main(verbosity=2)
