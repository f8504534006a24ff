"""`check_cpu_products(model)`: what the CPU's batch-invariance rests on, checked on this machine before it is relied
upon.

On the CPU the invariant linears and attention issue torch matmuls laid out so that MKL computes a row's bits the
same way whatever the number of rows and threads (`matmul.py`, `cpu_attention.py`): rows padded with zeros to a
multiple of a bound. That is a property of the library's kernels on a given processor, measured, not promised: one
machine's MKL took other kernels for 1 to 3 rows, another's also for 17-19 rows with sixteen threads, a third summed
4 and 8 rows of a 256-long reduction otherwise. So, once per process for each shape, thread count and bound, the
model's shapes are run here: a linear's first rows alone (`CHECKED_ROWS`) against the same rows among
`REFERENCE_ROWS` computed with one thread, and the last 1 to `CHECKED_QUERIES` queries of a prefill attended alone
against the whole prefill, with this process's thread count and with one (a thread may run with one: `_one_thread`).
The linears' bound (`matmul.MIN_ROWS`) and the attention's (`cpu_attention.MIN_QUERY_ROWS`) are each raised to the
first of `matmul.ROW_MULTIPLES` under which every one of the model's products holds, and every product passed before
in the process (the row counts checked under a smaller bound were not all multiples of the new one). Where none
does, `RowInvarianceError` names the product, the rows and the thread count, instead of log-probs that silently
differ from the trainer's by a few ulps.
"""

from __future__ import annotations

import threading

import torch

from rollout.invariant import cpu_attention, matmul
from rollout.invariant.cpu_attention import attend_in_torch
from rollout.invariant.matmul import tiled_matmul
from rollout.invariant.reductions import on_kernel_device
from rollout.validation import FieldError

REFERENCE_ROWS = 96
# Row counts checked against the reference, padded to 4, 8, 12, 20, 28, 36 and 60 rows: few rows, and counts a split
# among threads leaves remainders of (the measured failures of the 3-row and 16-row bounds were of these kinds).
CHECKED_ROWS = (1, 5, 12, 17, 27, 36, 60)
PREFILL_QUERIES = 80  # the attention's reference prefill; its last 1 to CHECKED_QUERIES queries are attended alone
CHECKED_QUERIES = 9
# A vocabulary-wide head is checked on this many output features (its products' columns are split among threads
# alike): 16,384 of 151,936 take 0.2 s here instead of 4.
MAX_CHECKED_FEATURES = 16384
_THREADS_LOCK = threading.RLock()  # the reference products flip the process's thread count to one
_BOUNDS_LOCK = threading.Lock()  # two checks at once raise the bounds one after the other
_CHECKED: dict[tuple, str | None] = {}  # (kind, shape..., threads, bound) -> the mismatch found, None for none
# Every product a check passed in this process, by kind, with the thread count it passed with: a raised bound must
# hold for them too, with their own counts (the row counts checked under a smaller bound were not its multiples).
_PASSED: dict[str, set[tuple[tuple, int]]] = {"linear": set(), "attention": set()}


class RowInvarianceError(FieldError):
    """This machine's matmuls are not row-invariant for a product the batch-invariant mode issues: the setting
    `batch_invariant` cannot be honoured here."""

    def __init__(self, reason: str):
        super().__init__("batch_invariant", reason)


def check_cpu_products(model: torch.nn.Module) -> None:
    """Check, with this process's thread count, that the batch-invariant CPU products of `model`'s shapes give each
    row the bits it gets among other rows with one thread (module docstring), raising the linears' and the
    attention's row bounds to the first of `matmul.ROW_MULTIPLES` under which they do: each `nn.Linear`'s in its
    dtype (the output head also in fp32, as `fp32_logits` computes it) and each MoE expert projection's, on seeded
    random weights of its shape (at most `MAX_CHECKED_FEATURES` output features), and the attention's. Once per
    process, shape, thread count and bound; autocast off, as the products it checks run. Nothing to check for a model off the CPU (or on the Triton
    kernels).

    Args:
        model: the model a batch-invariant forward will run (its linears' shapes and dtypes, its attention's heads).
    Raises:
        RowInvarianceError: a product whose rows differ under every bound, named with the rows and the thread count.
    """
    sample = next(model.parameters(), None)
    if sample is None or sample.device.type != "cpu" or on_kernel_device(sample):  # the Triton kernels' own promise
        return
    threads = torch.get_num_threads()
    shapes = {(m.out_features, m.in_features, m.weight.dtype) for m in model.modules() if _plain_linear(m)}
    shapes |= _expert_shapes(model)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if _plain_linear(head):
        shapes.add((head.out_features, head.in_features, torch.float32))
    heads, kv_heads, head_dim = _attention_shape(model)
    with torch.no_grad(), torch.autocast("cpu", enabled=False), _BOUNDS_LOCK:
        linears = {("linear", *shape) for shape in shapes}
        matmul.MIN_ROWS = _first_bound_that_holds(linears, matmul.MIN_ROWS, threads)
        if heads:
            attention = {("attention", heads, kv_heads, head_dim)}
            cpu_attention.MIN_QUERY_ROWS = _first_bound_that_holds(attention, cpu_attention.MIN_QUERY_ROWS, threads)


def _attention_shape(model: torch.nn.Module) -> tuple[int | None, int | None, int | None]:
    """(query heads, key/value heads, head size) from the model's text config; (None, None, None) without heads.

    Raises:
        FieldError: ("batch_invariant") a config that gives no one shape (Gemma 4's per-layer head sizes).
    """
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        heads = getattr(config, "num_attention_heads", None)
        if not heads:
            return None, None, None
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads
    except Exception as error:  # noqa: BLE001 - transformers raises its own kinds for per-layer attributes
        raise FieldError(
            "batch_invariant",
            f"{type(model).__name__}'s config gives no one attention shape ({type(error).__name__}: "
            f"{str(error)[:200]}): the invariant attention serves one shape for every layer",
        ) from None


def clear_checks() -> None:
    """Forget what was checked (the next `check_cpu_products` runs every shape again): after a change of the
    BLAS's own settings, and in tests. The bounds in use stay (a bound never falls: an engine may be running)."""
    _CHECKED.clear()
    for passed in _PASSED.values():
        passed.clear()


def _first_bound_that_holds(products: set[tuple], in_use: int, threads: int) -> int:
    """The first bound, from the one in use up through `matmul.ROW_MULTIPLES` (multiples of it only), under which
    every one of `products` holds with `threads` threads and with one (a thread that first runs torch while a
    reference product holds the count at one keeps one: `_one_thread`), and every product passed before with its
    own thread count and with one; raises naming the last bound's first mismatch."""
    if not products:  # a model without such products (no plain linear on the CPU)
        return in_use
    kind = next(iter(products))[0]
    before = sorted(_PASSED[kind], key=str)
    every = [(product, count) for product in sorted(products, key=str) for count in (threads, 1)]
    every += [(product, count) for product, threads_then in before for count in (threads_then, 1)]
    bounds = [in_use] + [b for b in matmul.ROW_MULTIPLES if b > in_use and b % in_use == 0]
    mismatch = None
    for bound in bounds:
        mismatch = next(filter(None, (_mismatch(product, count, bound) for product, count in every)), None)
        if mismatch is None:
            _PASSED[kind].update((product, threads) for product in products)
            return bound
    tried = " or ".join(str(b) for b in bounds)
    raise RowInvarianceError(
        f"on this CPU {mismatch}, with rows padded to a multiple of {tried}, so log-probs would not equal the "
        "trainer's bit for bit; another torch.set_num_threads count may hold (or run the mode on a GPU)"
    )


def _mismatch(product: tuple, threads: int, bound: int) -> str | None:
    """How `product`'s rows alone with `threads` threads (run with that many: this process's count, one, or the count
    an earlier check passed it with) differ from one thread's reference under `bound` (cached)."""
    key = (*product, threads, bound)
    if key not in _CHECKED:
        kind, *shape = product
        find = _linear_mismatch if kind == "linear" else _attention_mismatch
        _CHECKED[key] = _with_threads(threads, lambda: find(*shape, threads, bound))
    return _CHECKED[key]


def _expert_shapes(model: torch.nn.Module) -> set[tuple[int, int, torch.dtype]]:
    """(out_features, in_features, dtype) of each product an MoE model's eager experts issue: transformers' experts
    modules (`is_transposed` set by `use_experts_implementation`) hold one 3-D weight per projection, an expert's
    weight in its last two dimensions ((out, in); (in, out) when transposed)."""
    shapes = set()
    for module in model.modules():
        transposed = getattr(module, "is_transposed", None)
        if not isinstance(transposed, bool):
            continue
        for weight in module.parameters(recurse=False):
            if weight.dim() == 3 and weight.is_floating_point() and weight.device.type == "cpu":
                out_features, in_features = weight.shape[1:][::-1] if transposed else weight.shape[1:]
                shapes.add((out_features, in_features, weight.dtype))
    return shapes


def _plain_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and module.weight.device.type == "cpu"


def _rows(count: int, one: str = "row", many: str = "rows") -> str:
    return f"{count} {one if count == 1 else many}"


def _threads(count: int) -> str:
    return _rows(count, "thread", "threads")


def _with_threads(count: int, compute):  # noqa: ANN001, ANN202 - a thunk and its result
    """`compute()` with `count` intra-op threads (the thread count restored after). The count is the process's: a
    thread that first runs a torch operation meanwhile starts with that count (with one: slower; a bound must hold
    with one thread too, so never other bits)."""
    with _THREADS_LOCK:
        before = torch.get_num_threads()
        if count == before:
            return compute()
        torch.set_num_threads(count)
        try:
            return compute()
        finally:
            torch.set_num_threads(before)


def _one_thread(compute):  # noqa: ANN001, ANN202 - a thunk and its tensor
    """`compute()` with one intra-op thread (`_with_threads`)."""
    return _with_threads(1, compute)


def _linear_mismatch(out_features: int, in_features: int, dtype: torch.dtype, threads: int, bound: int) -> str | None:
    """How a linear's rows alone differ from the same rows among REFERENCE_ROWS with one thread, fp32 rows padded to
    a multiple of `bound` (None: they don't). Seeded random weights: a model's own may be zeros (a fresh LoRA B),
    which any order sums alike."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(min(out_features, MAX_CHECKED_FEATURES), in_features, generator=generator).to(dtype)
    rows = torch.randn(REFERENCE_ROWS, in_features, generator=generator).to(dtype)
    whole = _one_thread(lambda: tiled_matmul(rows, weight, bound))
    for count in CHECKED_ROWS:
        alone = tiled_matmul(rows[:count], weight, bound)
        if not torch.equal(alone, whole[:count]):
            difference = (alone.float() - whole[:count].float()).abs().max().item()
            return (
                f"a {dtype} linear of {in_features} -> {out_features} features computed {_rows(count)} alone with "
                f"{_threads(threads)} otherwise than among {REFERENCE_ROWS} rows with one (max |difference| "
                f"{difference:.3g})"
            )
    return None


def _attention_mismatch(heads: int, kv_heads: int, head_dim: int, threads: int, bound: int) -> str | None:
    """How a prefill's last queries attended alone differ from the whole prefill with one thread, products of a
    multiple of `bound` rows (None: they don't)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, PREFILL_QUERIES, head_dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, PREFILL_QUERIES, head_dim, generator=generator) for _ in range(2))
    positions = torch.arange(PREFILL_QUERIES)
    causal = (positions[None, :] <= positions[:, None])[None, None]
    scaling = head_dim**-0.5
    whole = _one_thread(lambda: attend_in_torch(query, key, value, causal, None, scaling, row_multiple=bound))
    for last in range(1, CHECKED_QUERIES + 1):
        alone = attend_in_torch(query[:, :, -last:], key, value, causal[:, :, -last:], None, scaling, None, bound)
        if not torch.equal(alone, whole[:, :, -last:]):
            difference = (alone - whole[:, :, -last:]).abs().max().item()
            return (
                f"the attention ({heads} heads, {kv_heads} key heads of {head_dim}) computed the last "
                f"{_rows(last, 'query', 'queries')} of a prefill alone with {_threads(threads)} otherwise than the "
                f"whole prefill with one (max |difference| {difference:.3g})"
            )
    return None
