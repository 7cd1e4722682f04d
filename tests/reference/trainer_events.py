"""Reads `lathe-worker train --output json`: one TrainerEvent (proto/lathe/v1/trainer.proto,
protobuf JSON) per line, and flattens each into the dict the Python reference prints
(lathe_reference.py), so that the two can be compared key by key:

  {"event": "step", "step", "steps", "loss", "lr", "grad_norm", "tokens", "tokens_per_s",
   "skipped", "loss_scale", "eval_loss", "mfu", "products", "memory": {...}, "phases": {...},
   "kernel_products": [{"phase", "dtype", "flops", "seconds"}, ...]}
  {"event": "done", "steps", "final_loss", "eval_loss", "adapter", "model", "seconds",
   "tokens_per_s", "peak_rss_bytes", "peak_bytes"}

plus "start", "checkpoint", "error" and "profile" as they come. Protobuf JSON writes 64-bit integers as
strings and non-finite doubles as "NaN"/"Infinity"; both are turned back into numbers, and a
non-finite number into None as the reference prints it."""
import json
import math


def _number(value):
    if isinstance(value, str):
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _int(value):
    return int(value) if value is not None else None


def flatten(event):
    if "event" in event:  # already flat: the reference's own output
        return event
    if "step" in event:
        step = event["step"]
        p = step.get("progress", {})
        return {"event": "step", "step": _int(p.get("step", 0)),
                "steps": _int(p.get("total_steps", 0)), "loss": _number(p.get("loss")),
                "lr": _number(p.get("lr", 0.0)), "grad_norm": _number(p.get("grad_norm", 0.0)),
                "tokens": _int(step.get("tokens", 0)),
                "tokens_per_s": _number(p.get("tokens_per_second", 0.0)),
                "skipped": step.get("skipped", False),
                "loss_scale": _number(p.get("loss_scale", 1.0)),
                "eval_loss": _number(p.get("eval_loss")), "mfu": _number(p.get("mfu", 0.0)),
                "products": p.get("products", ""),
                "step_seconds": _number(p.get("step_seconds", 0.0)),
                "memory": {k: _int(v) for k, v in p.get("memory", {}).items()},
                "phases": {k: _number(v) for k, v in p.get("phases", {}).items()
                           if k != "kernel_products"},
                "kernel_products": [
                    {"phase": x.get("phase"), "dtype": x.get("dtype"),
                     "flops": _number(x.get("flops", 0.0)),
                     "seconds": _number(x.get("seconds", 0.0))}
                    for x in p.get("phases", {}).get("kernel_products", [])]}
    if "done" in event:
        d = event["done"]
        return {"event": "done", "steps": _int(d.get("steps", 0)),
                "skipped_steps": _int(d.get("skipped_steps", 0)),
                "final_loss": _number(d.get("final_loss")),
                "eval_loss": _number(d.get("eval_loss")),
                "adapter": d.get("adapter_path") or None, "model": d.get("model_path") or None,
                "seconds": _number(d.get("seconds", 0.0)),
                "tokens_per_s": _number(d.get("tokens_per_second", 0.0)),
                "peak_rss_bytes": _int(d.get("peak_rss_bytes", 0)),
                "peak_bytes": _int(d.get("peak_bytes", 0))}
    for kind in ("start", "checkpoint", "error", "profile"):
        if kind in event:
            return {"event": kind, **event[kind]}
    raise ValueError(f"not a trainer event: {event}")


def read_events(text):
    """Every event in `text` (the trainer's stdout), flattened; other lines are skipped."""
    events = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            events.append(flatten(json.loads(line)))
    return events
