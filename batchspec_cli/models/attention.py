"""Attention: the model forward of a group, its masks per layer type, and the folded GQA kernel.

A group shares one column layout (``align``): row ``i`` has ``pad[i]`` pad columns, then
its content; a forward writes ``n_new`` tokens at columns ``start..start+n_new-1``. Every
mask is measured in each row's own content positions (``position = column - pad``), so
realignment and grouping need nothing else. A key column ``c`` is allowed for the query
in column ``q`` when ``pad <= c <= q`` and, by the layer's type,

- ``full_attention``: always;
- ``sliding_attention`` (window ``W``): ``q - c < W`` (the last ``W`` positions, the query's own included);
- ``chunked_attention`` (chunk ``C``): ``(c - pad) // C == (q - pad) // C`` (the query's own chunk).

A pad query (``q < pad``; a prefill or a draft catch-up covers pad columns) attends to its
own column only: no query row is ever fully masked, so no softmax (an eager one in float32
over a float64 ``finfo.min`` mask included) makes a NaN that the next layer's K/V would
carry into real rows. Worked example, ``W = 2``, one row with ``pad = 1``, queries at
columns 0..3 (``x`` allowed)::

    keys     0 1 2 3       full        sliding (W = 2)
    query 0  x . . .       (pad: itself only)
    query 1  . x . .       . x . .     . x . .
    query 2  . x x .       . x x .     . x x .
    query 3  . x x x       . x x x     . . x x

The cache keeps every column (no ring buffer): a sliding layer's memory is a full layer's.
A model whose layer types differ gets a dict of masks keyed by layer type (transformers
5.x models take one); a model whose layers are all of one type gets that type's mask.

ALiBi models (Bloom, Falcon with ``alibi``) build their position bias from a 2D padding
mask (key position = ``cumsum(mask) - 1``, i.e. ``c - pad``, as for a lone prompt), so they
get the 2D mask and build the causal part themselves. Their attention cannot be told that a
pad query may attend to itself, so their forwards never hold a pad query: a group whose
forward starts before a row's content is run as sub-groups, each from its rows' first
content column (only the last position's logits are then available).

A CPU prefill of a model with full-attention layers only runs packed instead (``packed_forward``):
the rows' own columns one after another in one sequence, no padding, no mask, each row causal on
its own keys; pad columns are then never computed.

The folded kernel (``folded_sdpa``): stock SDPA with an explicit mask repeats every KV head
``n_rep`` times for grouped-query attention; the kernel folds the query heads into the query
length instead. It is registered in transformers' attention registry for the run only, and
only for models running stock SDPA without soft-capping or attention sinks (those keep their
own attention function).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import native

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
LAYER_TYPES = (FULL, SLIDING, CHUNKED)  # what the masks here can express


@dataclass(frozen=True)
class Layers:
    """What a model's attention layers need from a forward's mask (``layers_of``)."""

    types: tuple[str, ...] = (FULL,)  # the distinct layer types, e.g. (full_attention, sliding_attention)
    window: int | None = None  # sliding_attention: keys within the last `window` positions
    chunk: int | None = None  # chunked_attention: keys within the query's chunk of `chunk` positions
    padding_mask: bool = False  # ALiBi: the model takes a 2D padding mask [group, keys] and builds the rest


ALL_FULL = Layers()


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_types(config) -> list[str]:
    """Every layer's attention type, as transformers builds the model's cache for this config."""
    text = text_config(config)
    types = getattr(text, "layer_types", None)
    if types is not None:
        return [str(t) for t in types]
    n = int(getattr(text, "num_hidden_layers", 1) or 1)
    if getattr(text, "attention_chunk_size", None) is not None:
        return [CHUNKED] * n
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True) is not False:
        return [SLIDING] * n
    return [FULL] * n


def kv_column_bytes(model) -> int:
    """KV bytes one row's one column takes in a ``SlotCache`` of ``model``, from its config (an estimate for budgets:
    every layer holds keys and values of ``num_key_value_heads x head_dim`` in the model's dtype)."""
    text = text_config(model.config)
    heads = getattr(text, "num_attention_heads", 1) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    layers = int(getattr(text, "num_hidden_layers", 1) or 1)
    return 2 * layers * kv_heads * head_dim * next(model.parameters()).element_size()


def uses_alibi(config) -> bool:
    """Bloom and ALiBi Falcon add a position bias built from the 2D padding mask."""
    text = text_config(config)
    return text.model_type == "bloom" or (text.model_type == "falcon" and bool(getattr(text, "alibi", False)))


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Layers, read once per model


def layers_of(model) -> Layers:
    layers = _LAYERS.get(model)
    if layers is None:
        text = text_config(model.config)
        types = tuple(sorted(set(layer_types(text)), key=LAYER_TYPES.index))
        layers = Layers(types, getattr(text, "sliding_window", None) if SLIDING in types else None,
                        getattr(text, "attention_chunk_size", None) if CHUNKED in types else None, uses_alibi(text))
        _LAYERS[model] = layers
    return layers


def attention_inputs(pad: torch.Tensor, start: int, n_new: int, dtype: torch.dtype,
                     layers: Layers = ALL_FULL) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """Masks and position ids for ``n_new`` tokens written at columns ``start..``.

    pad: [group] left padding of each row (the group shares one column layout).
    Returns the mask and position_ids [group, n_new]. The mask is additive, [group, 1, n_new,
    start + n_new] (0 allowed, finfo.min masked), one per layer type in a dict when the
    model's layer types differ; or, for ALiBi models, the 2D padding mask [group, start + n_new].
    """
    device = pad.device
    cols = torch.arange(start + n_new, device=device)  # key columns
    qcols = torch.arange(start, start + n_new, device=device)  # query columns
    positions = (qcols[None, :] - pad[:, None]).clamp(min=0)
    if layers.padding_mask:
        return (cols[None, :] >= pad[:, None]).long(), positions
    key, query, row_pad = cols[None, None, :], qcols[None, :, None], pad[:, None, None]
    # [group, n_new, keys]: keys from the row's first content column up to the query; a pad query (q < pad) keeps
    # its own column only (from min(pad, q) to q)
    content = (key >= torch.minimum(row_pad, query)) & (key <= query)
    masks = {}
    for kind in layers.types:
        allowed = content
        if kind == SLIDING:
            allowed = allowed & (query - key < layers.window)
        elif kind == CHUNKED:  # a pad query's own column is in its own chunk
            allowed = allowed & ((key - row_pad) // layers.chunk == (query - row_pad) // layers.chunk)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        masks[kind] = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
    return (masks if len(masks) > 1 else next(iter(masks.values()))), positions


def group_forward(model, cache, cache_kwarg: str, rows_index, input_ids: torch.Tensor, pad: torch.Tensor, start: int,
                  logits_to_keep: int = 0) -> torch.Tensor:
    """One forward of a group over new tokens at columns ``start..``; returns logits.

    cache: the model's ``align.SlotCache``; rows_index: the group's slots (a slice or indices).
    input_ids: [group, n_new]; pad: [group]. Logits: [group, n_new or logits_to_keep, vocab].
    """
    layers = layers_of(model)
    if layers.padding_mask and int(pad.max()) > start:  # a host read, for ALiBi models only
        return _from_content(model, cache, cache_kwarg, rows_index, input_ids, pad, start, logits_to_keep)
    dtype = next(model.parameters()).dtype
    mask, positions = attention_inputs(pad, start, input_ids.shape[1], dtype, layers)
    cache.bind(rows_index, start)
    _spans.value = column_spans(pad, start, input_ids.shape[1])
    try:
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                    use_cache=True, logits_to_keep=logits_to_keep, **{cache_kwarg: cache})
    finally:
        _spans.value = None
    return out.logits


SPAN_MIN_ROWS = 8  # a span of fewer rows saves less than its extra kernel call costs
SPAN_MAX_QUERY = 64  # longer forwards (prefills) are compute in the query, not reads of padding


def column_spans(pad: torch.Tensor, start: int, n_new: int) -> list[tuple[int, int, int]] | None:
    """Contiguous row ranges of a CPU forward and the first key column each must read: ``(first row, end row,
    first column)``, when reading fewer padding columns pays; else ``None`` (one kernel over every column).

    A group's rows share one column layout, left-padded to its longest row: a short row's attention reads its
    padding columns only to mask them. Rows are admitted bucket by bucket, shortest first, so neighbouring slots
    have similar padding: each run of rows from its smallest padding (never past ``start``, where the forward's
    first query is, so a pad query still sees its own column) skips the columns every row of the run masks. On a
    CUDA device (reading ``pad`` would be a host sync) and for long forwards: ``None``.
    """
    rows = pad.shape[0]
    if pad.device.type != "cpu" or n_new > SPAN_MAX_QUERY or rows < 2 * SPAN_MIN_ROWS:
        return None
    pads = pad.tolist()
    per = max(SPAN_MIN_ROWS, -(-rows // 8))
    spans = [(a, min(a + per, rows), min(start, *pads[a: a + per])) for a in range(0, rows, per)]
    columns = start + n_new
    read = sum((b - a) * (columns - c) for a, b, c in spans)
    if read > 0.8 * rows * (columns - min(start, *pads)):
        return None
    return spans


_spans = threading.local()  # the running forward's column_spans, read by _folded_sdpa (one forward per thread)


def _from_content(model, cache, cache_kwarg: str, rows_index, input_ids: torch.Tensor, pad: torch.Tensor, start: int,
                  logits_to_keep: int) -> torch.Tensor:
    """``group_forward`` without pad queries: rows run in sub-groups from their first content column.

    Only the last position's logits exist then ([group, 1, vocab]); a row with no content in
    these columns gets zeros (it has no next token to predict here).
    """
    if logits_to_keep != 1:
        raise ValueError("a forward over pad columns of an ALiBi model keeps the last logits only")
    n_new = input_ids.shape[1]
    slots = (torch.arange(rows_index.start, rows_index.stop, device=pad.device) if isinstance(rows_index, slice)
             else rows_index)
    firsts = [max(start, p) for p in pad.tolist()]
    logits = None
    for first in sorted(set(firsts)):
        if first >= start + n_new:
            continue
        rows = torch.tensor([i for i, f in enumerate(firsts) if f == first], device=pad.device)
        part = group_forward(model, cache, cache_kwarg, slots[rows], input_ids[rows, first - start:], pad[rows],
                             first, 1)
        if logits is None:
            logits = part.new_zeros(len(firsts), 1, part.shape[-1])
        logits[rows] = part
    return logits


# -- packed prefill (CPU) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One row's part of a packed forward: the slot's columns ``start..end-1`` are written; its keys run from
    ``first``, its first content column (``first..start-1`` are in the cache already: a shared prefix, or the
    earlier part of a row longer than one forward)."""

    slot: int
    first: int
    start: int
    end: int


class Packing:
    """The pieces of one packed forward and where each one's queries and keys lie in it.

    The forward's new tokens are the pieces' columns one after another (queries ``q0..q1``). Its keys
    (``SlotCache`` returns them) are the new keys as they are when no piece has earlier columns (``whole``), else
    each piece's keys from its ``first`` column, one after another (``k0..k1``)."""

    def __init__(self, pieces: list[Piece]):
        self.pieces = pieces
        self.whole = all(p.first == p.start for p in pieces)
        self.spans: list[tuple[int, int, int, int]] = []  # (q0, q1, k0, k1) per piece
        q = k = 0
        for p in pieces:
            n = p.end - p.start
            m = n if self.whole else p.end - p.first
            self.spans.append((q, q + n, k, k + m))
            q, k = q + n, k + m


def packable(model, device: torch.device) -> bool:
    """Whether a prefill of ``model`` may run packed (``packed_forward``): on a CPU (each piece is its own kernel
    call), with the folded kernel (which knows packings), every layer full attention and no ALiBi bias."""
    return (device.type == "cpu" and getattr(model.config, "_attn_implementation", None) == FOLDED_SDPA
            and layers_of(model) == Layers(types=(FULL,)))


def pack_rows(rows: list[tuple[int, int, int, int]], most: int) -> Iterator[list[Piece]]:
    """The packed forwards that prefill ``rows`` (slot, first content column, first new column, end column), each at
    most ``most`` tokens. Rows stay whole, in order; a row longer than ``most`` runs alone, in pieces of ``most``
    columns. A row's pieces so depend on its own length only, never on the rows beside it."""
    batch, size = [], 0
    for slot, first, start, end in rows:
        if end - start > most:
            if batch:
                yield batch
                batch, size = [], 0
            for a in range(start, end, most):
                yield [Piece(slot, first, a, min(end, a + most))]
            continue
        if end <= start:
            continue
        if batch and size + end - start > most:
            yield batch
            batch, size = [], 0
        batch.append(Piece(slot, first, start, end))
        size += end - start
    if batch:
        yield batch


def packed_forward(model, cache, cache_kwarg: str, tokens: torch.Tensor, pieces: list[Piece]) -> None:
    """Prefill the pieces' columns of ``tokens`` [slots, columns] in one forward of one sequence: no padding and no
    mask, each row attending causally to its own columns only (``_packed_attend``). Writes their KV into
    ``cache``; the logits are not wanted (a prefill stops before a row's last prompt token)."""
    packing = Packing(pieces)
    device = tokens.device
    ids = torch.cat([tokens[p.slot, p.start : p.end] for p in pieces])[None]
    positions = torch.cat([torch.arange(p.start - p.first, p.end - p.first, device=device) for p in pieces])[None]
    # a 4D mask is taken as it is (transformers builds none); the folded kernel ignores it for a packing
    unused = torch.zeros(1, 1, 1, 1, dtype=next(model.parameters()).dtype, device=device)
    cache.bind_packed(packing)
    _packing.value = packing
    try:
        model(input_ids=ids, attention_mask=unused, position_ids=positions, use_cache=True, logits_to_keep=1,
              **{cache_kwarg: cache})
    finally:
        _packing.value = None
        cache.bind_packed(None)


_packing = threading.local()  # the running packed forward's Packing, read by _folded_sdpa (one forward per thread)


def _packed_attend(query, key, value, packing: Packing, scaling: float | None, built=None) -> torch.Tensor:
    """Each piece's queries against its own keys: causal when its keys are its new columns, else causal from the
    bottom right (the query at new column i sees every earlier column and the new ones up to i). ``built``: the
    model's own kernels (``native.causal``), where they apply; else SDPA."""
    outs = []
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    for q0, q1, k0, k1 in packing.spans:
        q, k, v = query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1]
        own = native.causal(built, q, k, v, scale)
        if own is not None:
            outs.append(own.transpose(0, 1)[None])  # [1, H, n, D], as SDPA's
            continue
        if k1 - k0 == q1 - q0:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                                   enable_gqa=True)
        else:
            shift = (k1 - k0) - (q1 - q0)
            allowed = (torch.arange(k1 - k0, device=query.device)[None, :]
                       <= torch.arange(shift, k1 - k0, device=query.device)[:, None])
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling,
                                                                   enable_gqa=True)
        outs.append(out)
    return torch.cat(outs, 2).transpose(1, 2).contiguous()


# -- the folded GQA kernel --------------------------------------------------------------------------

FOLDED_SDPA = "batchspec_sdpa"
_FOLD_MAX_QUERY = 64  # longer queries (prefill): repeating the mask would cost more; SDPA's own GQA on a CPU


def _folded_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs):
    """SDPA for grouped-query attention with an explicit mask that never repeats K/V.

    Stock SDPA attention repeats every key/value head ``n_rep`` times (a copy of the whole
    cache, per layer and forward) whenever a mask is given and the query is longer than one
    token: every verify forward and every draft catch-up here. Instead, the ``n_rep`` query
    heads that share a KV head are folded into the query length
    (``[B, H, q, D] -> [B, H/n_rep, n_rep*q, D]``) and the mask, shared by all heads, is
    repeated along it. This is stock SDPA's own one-token case (``pack_gqa``) for q > 1. On a
    CPU it runs for one-token queries too (every decode step): stock SDPA with a mask there took
    5x as long (one layer, 32 rows of 700 columns, bfloat16: 21.5 ms against 4.1). All other
    cases go to stock SDPA unchanged, and so does anything this kernel does not implement
    (soft-capping, attention sinks, a position bias): it never drops a feature.
    """
    packing = getattr(_packing, "value", None)
    if packing is not None:
        built = getattr(module, native.ATTRIBUTE, None)
        return _packed_attend(query, key, value, packing, scaling, built), None
    spans = getattr(_spans, "value", None)
    if spans is not None and attention_mask is not None and attention_mask.dim() == 4 \
            and spans[-1][1] == query.shape[0] == key.shape[0] and not kwargs.get("position_bias"):
        outs = [_attend(module, query[a:b], key[a:b, :, c:], value[a:b, :, c:], attention_mask[a:b, ..., c:],
                        dropout, scaling, is_causal, **kwargs)[0] for a, b, c in spans]
        return torch.cat(outs), None
    return _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def _attend(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
            is_causal: bool | None = None, **kwargs):
    n_rep = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    built = getattr(module, native.ATTRIBUTE, None)  # a CPU model's own kernels (native.attach)
    kernel = built.attend if built is not None else None
    if (kernel is not None and q_len <= native.MAX_QUERY and dropout == 0.0 and attention_mask is not None
            and attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[2] in (1, q_len)
            and query.device.type == "cpu" and query.dtype in native.DTYPES
            and query.dtype == key.dtype == value.dtype and heads % key.shape[1] == 0
            and key.shape[-1] == value.shape[-1] == dim
            and not any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux"))):
        return native.attend(kernel, query, key, value, attention_mask,
                             dim ** -0.5 if scaling is None else scaling), None
    if (n_rep == 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
            or (q_len == 1 and query.device.type != "cpu") or key.shape[-1] != value.shape[-1]
            or any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if q_len > _FOLD_MAX_QUERY:
        if query.device.type != "cpu":  # CUDA's fused kernels take no GQA with a mask: stock SDPA repeats K/V
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
        # A prefill on a CPU: its flash kernel reads each KV head for its query heads (1.1-1.6x repeating them)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    query = query.reshape(batch, heads // n_rep, n_rep * q_len, dim)
    # row r*q + i of the folded query is query row i; one query row's mask broadcasts (a copy cost as much as
    # the attention itself at batch 1: 131 us against 70 for one layer, the same numbers)
    mask = attention_mask if q_len == 1 else attention_mask.repeat(1, 1, n_rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


def foldable(model) -> bool:
    """A model running stock SDPA whose attention has nothing the folded kernel lacks."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or uses_alibi(config):
        return False
    text = text_config(config)
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return False
    return not any(getattr(m, "sinks", None) is not None for m in model.modules())


_registered = 0  # runs (and permanent switches) that use the registry entries
_lock = threading.Lock()


def _register() -> None:
    """Add ``_folded_sdpa`` to transformers' attention registries under its own name (no other entry changes)."""
    global _registered
    with _lock:
        if _registered == 0:
            AttentionInterface.register(FOLDED_SDPA, _folded_sdpa)
            AttentionMaskInterface.register(FOLDED_SDPA, sdpa_mask)  # calls without a 4D mask build it as for SDPA
        _registered += 1


def _unregister() -> None:
    global _registered
    with _lock:
        _registered -= 1
        if _registered == 0:
            AttentionInterface._global_mapping.pop(FOLDED_SDPA, None)
            AttentionMaskInterface._global_mapping.pop(FOLDED_SDPA, None)


def use_folded_sdpa(model) -> None:
    """Switch a model ``foldable`` runs to ``_folded_sdpa`` for good, registering the kernel for good (benchmarks).

    This changes the caller's model and transformers' registry; ``folded_sdpa`` does the same for a block only.
    """
    if foldable(model):
        _register()
        model.set_attn_implementation(FOLDED_SDPA)


def _contiguous_input(module, args):
    return (args[0].contiguous(), *args[1:])


@contextmanager
def contiguous_head(*models):
    """Feed each model's output head a contiguous input inside the block.

    A forward with ``logits_to_keep`` hands the head a slice of the last positions (``[group, 1, hidden]`` of a
    ``[group, T, hidden]`` tensor). A strided 3D input sends ``F.linear`` down its batched path, which expands and
    copies the whole head weight once per row: on a CPU in bfloat16 that copy was most of a prefill's time. A
    forward pre-hook on the head makes the input contiguous (the same numbers); it is removed after the block.
    """
    hooks = []
    try:
        for model in models:
            head = model.get_output_embeddings()
            if head is not None:
                hooks.append(head.register_forward_pre_hook(_contiguous_input))
        yield
    finally:
        for hook in hooks:
            hook.remove()


@contextmanager
def for_run(*models):
    """What the engine's models run with for one run: the folded GQA kernel and a contiguous output head."""
    with folded_sdpa(*models), contiguous_head(*models):
        yield


@contextmanager
def folded_sdpa(*models):
    """Run the ``foldable`` models with ``_folded_sdpa`` inside the block; afterwards each gets its own
    implementation back, and the kernel leaves transformers' registry when no run uses it."""
    switched = [m for m in models if foldable(m)]
    if not switched:
        yield
        return
    _register()
    try:
        for model in switched:
            model.set_attn_implementation(FOLDED_SDPA)
        yield
    finally:
        for model in switched:
            model.set_attn_implementation("sdpa")
        _unregister()
