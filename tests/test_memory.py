"""Host buffers of the runtime (kvpass.runtime.store.cpu_empty): huge pages for the caches on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kvpass.runtime.store import OwnedKV, cpu_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The kernel's THP mode (the bracketed word), or None where the machine has none."""
    if not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds ``t``'s first byte (/proc/self/smaps)."""
    addr, kib, inside = t.data_ptr(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            kib = int(line.split()[1])
    return kib


def test_cpu_empty_is_a_plain_tensor_on_huge_page_boundaries():
    """Shape, dtype, contiguity and writes are torch.empty's; a buffer of 2 MiB or more starts on a 2 MiB
    boundary (where a huge page can back it), a smaller one is a plain torch.empty."""
    big = cpu_empty((2, 3, 4096, 64), torch.float32)
    assert big.shape == (2, 3, 4096, 64) and big.dtype == torch.float32 and big.is_contiguous()
    big.copy_(torch.arange(big.numel(), dtype=torch.float32).view_as(big))
    assert big[1, 2, 4095, 63] == big.numel() - 1
    small = cpu_empty((2, 3, 8, 64), torch.float16)
    assert small.shape == (2, 3, 8, 64) and small.dtype == torch.float16 and small.storage_offset() == 0
    if sys.platform == "linux":
        assert big.data_ptr() % (2 << 20) == 0


def test_an_owned_cache_on_cpu_is_backed_by_huge_pages_where_the_kernel_offers_them():
    """The owned store's buffers of an 8k-token cache are faulted in as huge pages where the kernel's THP
    mode is ``madvise`` (it gives them only to memory that asked) or ``always``: the scattered rows of a
    selection then cost no TLB miss each. Where the kernel has no THP (``never``, or no Linux) the buffer
    is still an exact cache, with no huge page."""
    st = OwnedKV(host=True)
    k = torch.randn(1, 3, 8192, 64)
    st.append(None, None, k, k.clone())
    assert torch.equal(st.views()[0], k)
    if _thp_mode() in ("madvise", "always"):
        assert _huge_kib(st.k) >= 2048, "the keys' buffer has no huge page"
    elif Path("/proc/self/smaps").exists():
        assert _huge_kib(st.k) == 0
