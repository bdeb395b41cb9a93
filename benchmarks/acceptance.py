"""How often the shipped draft's tokens would be accepted when sampling, by rule: rejection sampling vs Gumbel coupling.

    python benchmarks/acceptance.py --prompts 12 --max-new-tokens 64          # T 0.7, top-p 0.9 (a couple of minutes)
    python benchmarks/acceptance.py --temperature 1.0 --top-p 1.0 --top-k 50 --out results/acceptance.json

A measurement on Spec-Bench prompts (``turns[0]`` with the chat template), never used to tune
anything. For every prompt the target samples its own continuation (Hugging Face
``generate``, the given temperature / top-k / top-p); then target and draft are
teacher-forced along prompt + continuation in one forward each, and at every position of
the continuation, with p = the target's warped distribution and q = the draft's
(``sampling.warp_probs``, the engine's warping):

- δ = total variation distance(p, q) = ½ Σ|p − q|;
- ``rejection`` = 1 − δ: the acceptance of speculative (rejection) sampling (Leviathan et al.);
- ``gumbel`` = P(argmax(log p + g) = argmax(log q + g)) over Gumbel noise g shared by both,
  the acceptance of the Gumbel-max coupling the engine uses (it keeps outputs independent of
  the draft); estimated with ``--draws`` independent noise vectors per position (torch's RNG);
- ``bound`` = (1 − δ) / (1 + δ): the coupling's guaranteed lower bound.

Printed: per-category and overall means over positions (a table), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from batchspec_cli.engine import sampling  # noqa: E402
from batchspec_cli.io.prompts import render_prompt  # noqa: E402
from batchspec_cli.models import loading as models  # noqa: E402
from bench import SPEC_BENCH, spec_bench_groups  # noqa: E402

METRICS = ("delta", "rejection", "gumbel", "bound")


def to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Slice or pad draft logits [..., Vd] to the target's vocabulary (as the engine does)."""
    extra = vocab - logits.shape[-1]
    if extra < 0:
        return logits[..., :vocab]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=torch.finfo(logits.dtype).min)
    return logits


def gumbel_agreement(p: torch.Tensor, q: torch.Tensor, draws: int, generator: torch.Generator) -> torch.Tensor:
    """P(argmax(log p + g) == argmax(log q + g)) per position, estimated with ``draws`` noise vectors each.

    p, q: [n, V] probabilities. Tokens outside both supports can never win either argmax, so the
    noise is drawn over the union of the supports only (the same law as over the whole vocabulary).
    """
    out = torch.empty(p.shape[0], dtype=torch.float64)
    for i in range(p.shape[0]):
        support = ((p[i] > 0) | (q[i] > 0)).nonzero().squeeze(1)
        lp, lq = p[i, support].log(), q[i, support].log()  # -inf outside each one's own support
        u = torch.rand(draws, support.numel(), generator=generator, dtype=torch.float64).clamp_min(1e-300)
        g = -torch.log(-torch.log(u))
        out[i] = ((lp + g).argmax(-1) == (lq + g).argmax(-1)).double().mean()
    return out


@torch.no_grad()
def measure(tgt, drf, prompt_ids: list[int], args, seed: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    device = tgt.model.device
    eos = models.eos_ids(tgt.model, tgt.tokenizer)
    pad = tgt.tokenizer.pad_token_id if tgt.tokenizer.pad_token_id is not None else eos[0]
    config = GenerationConfig(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None,
                              max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    ids = torch.tensor([prompt_ids], device=device)
    torch.manual_seed(seed)
    full = tgt.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    n = full.shape[1] - ids.shape[1]
    if n <= 0:
        return {m: torch.empty(0, dtype=torch.float64) for m in METRICS}
    vocab = tgt.model.get_output_embeddings().weight.shape[0]
    t_logits = tgt.model(input_ids=full).logits[:, ids.shape[1] - 1 : -1].float()  # [1, n, V]: predicts each token
    d_logits = to_vocab(drf.model(input_ids=full).logits[:, ids.shape[1] - 1 : -1].float(), vocab)
    settings = (torch.tensor([args.temperature]), torch.tensor([args.top_k]), torch.tensor([args.top_p]))
    filters = (args.top_k > 0, args.top_p < 1.0)
    p = sampling.warp_probs(t_logits, *settings, filters=filters)[0].cpu()  # [n, V] float64
    q = sampling.warp_probs(d_logits, *settings, filters=filters)[0].cpu()
    delta = 0.5 * (p - q).abs().sum(-1)
    return {"delta": delta, "rejection": 1 - delta, "gumbel": gumbel_agreement(p, q, args.draws, generator),
            "bound": (1 - delta) / (1 + delta)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", "-T", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--draws", type=int, default=256, help="Gumbel noise vectors per position")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON record here")
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("--temperature must be > 0 (greedy acceptance is measured by bench.py)")
    if args.threads:
        torch.set_num_threads(args.threads)

    draft_spec = args.draft or (str(models.default_draft_path()) if args.target is None and
                                models.default_draft_path() else None)
    if draft_spec is None:
        sys.exit("no draft: pass --draft (the default target's shipped draft is missing)")
    tgt = models.load_model(args.target, args.dtype, args.device, quiet=True)
    drf = models.load_draft(draft_spec, tgt, args.dtype, args.device, quiet=True)
    generator = torch.Generator().manual_seed(args.seed)
    per_category: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    started = time.perf_counter()
    for i, (category, prompt) in enumerate(spec_bench_groups(SPEC_BENCH, args.prompts)):
        values = measure(tgt, drf, render_prompt(tgt.tokenizer, prompt, True, None), args, args.seed + i, generator)
        for metric, v in values.items():
            per_category[category][metric].append(v)
    elapsed = time.perf_counter() - started

    def means(parts: dict[str, list[torch.Tensor]]) -> dict:
        cat = {m: torch.cat(parts[m]) for m in METRICS}
        n = cat["delta"].numel()
        return {"positions": n, **{m: (cat[m].mean().item() if n else None) for m in METRICS}}

    table = {c: means(per_category[c]) for c in sorted(per_category)}
    overall = means({m: [v for c in per_category.values() for v in c[m]] for m in METRICS})
    print(f"Spec-Bench, {args.prompts} prompts, up to {args.max_new_tokens} sampled target tokens each, "
          f"T {args.temperature}, top-p {args.top_p}, top-k {args.top_k or 'off'}, {args.draws} Gumbel draws per "
          f"position; target {tgt.name}, draft {draft_spec}; {elapsed:.0f} s. Means over positions:")
    print(f"{'category':16} {'positions':>9} {'TV δ':>7} {'1-δ (rejection)':>16} {'Gumbel coupling':>16} "
          f"{'(1-δ)/(1+δ)':>12}")
    for name, row in [*table.items(), ("overall", overall)]:
        if not row["positions"]:
            print(f"{name:16} {0:>9}")
            continue
        print(f"{name:16} {row['positions']:>9} {row['delta']:>7.3f} {row['rejection']:>16.3f} "
              f"{row['gumbel']:>16.3f} {row['bound']:>12.3f}", flush=True)
    record = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "top_p": args.top_p, "top_k": args.top_k, "draws": args.draws, "seed": args.seed,
              "target": tgt.name, "draft": draft_spec, "device": str(tgt.model.device), "seconds": elapsed,
              "categories": table, "overall": overall}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
