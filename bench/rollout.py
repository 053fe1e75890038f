"""Rollout throughput: ftrt.grpo's batched KV-cache sampling vs recomputing the prefix per token.

One process, the default GRPO model and task (reverse 6 of 16, G=16), 16 prompts per rollout
(what one of 2 ranks samples per step): completion tokens per second of
:func:`ftrt.policy.sample.rollout`, beside the same sampler that runs the whole sequence through
the model for every new token (no cache), in the same invocation. Both draw the same seeded
uniforms, so they must produce the same tokens; the benchmark checks that.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _no_cache(model, task, vocab, *, seed, step, prompt_ids, group, max_new, temperature):
    import torch

    from ftrt.policy.sample import make_prompts, pick, uniforms

    prompts, _ = make_prompts(task, vocab, seed, prompt_ids)
    u = uniforms(seed, step, prompt_ids, group, max_new)
    seq = prompts.repeat_interleave(group, dim=0)
    n = seq.shape[0]
    done = torch.zeros(n, dtype=torch.bool)
    out = torch.full((n, max_new), vocab.pad, dtype=torch.long)
    with torch.no_grad():
        for t in range(max_new):
            logits, _ = model(torch.cat([seq, out[:, :t]], dim=1))
            tok = pick(logits[:, -1], u[:, t], temperature)
            tok = torch.where(done, torch.full_like(tok, vocab.pad), tok)
            out[:, t] = tok
            done = done | (tok == vocab.eos)
            if bool(done.all()):
                break
    return out


def main(argv: list[str]) -> int:
    import argparse

    import torch

    from ftrt.grpo.config import GRPOConfig
    from ftrt.policy.model import build_policy
    from ftrt.policy.sample import rollout
    from ftrt.policy.tasks import Vocab, make_task

    p = argparse.ArgumentParser(prog="python -m bench rollout", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = GRPOConfig()
    task = make_task(cfg.task.name, cfg.task.params)
    vocab = Vocab(task)
    max_new = task.answer_len
    torch.manual_seed(0)
    model = build_policy(cfg.model, len(vocab), task.prompt_len + 2 + max_new)
    kw = dict(seed=0, group=cfg.group_size, max_new=max_new, temperature=cfg.temperature)
    times: dict[str, list[float]] = {"kv_cache": [], "recompute": []}
    tokens = 0
    same = True
    for r in range(args.repeats + 2):
        ids = list(range(r * args.prompts, (r + 1) * args.prompts))
        t0 = time.perf_counter()
        batch = rollout(model, task, vocab, step=r, prompt_ids=ids, **kw)
        t1 = time.perf_counter()
        ref = _no_cache(model, task, vocab, step=r, prompt_ids=ids, **kw)
        t2 = time.perf_counter()
        same &= bool(torch.equal(batch.sequences[:, task.prompt_len + 2:], ref))
        if r >= 2:  # warm-up rounds
            times["kv_cache"].append(t1 - t0)
            times["recompute"].append(t2 - t1)
            tokens = int(batch.mask.sum())
    # Tokens per rollout vary a little with the samples; use the last one's count for both.
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"rollout of {args.prompts} prompts x G={cfg.group_size}, {max_new} new tokens max, "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"{'sampler':<12}{'median':>10}{'tokens/s':>12}{'speedup':>10}")
    for k in ("recompute", "kv_cache"):
        print(f"{k:<12}{med[k] * 1000:>8.1f}ms{tokens / med[k]:>12,.0f}{med['recompute'] / med[k]:>9.2f}x")
    print(f"same tokens from both samplers: {same}")
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": "python -m bench rollout " + " ".join(argv),
              "median_s": med, "tokens": tokens, "tokens_per_s": {k: tokens / v for k, v in med.items()},
              "identical_samples": same}
    dest = ROOT / "bench" / "results"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"rollout-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
