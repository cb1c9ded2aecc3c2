"""`trainer.keep_freed_memory` (train/allocator.py): freed large buffers stay mapped for reuse; a training run's
oneDNN kernel cache is capped.

Each case runs in a fresh interpreter, since the setting is process-wide and cannot be undone: a 256 MiB
tensor is filled, freed, and the resident size is read back from /proc; under the bounded policy, 8 MiB
chunks freed between live small ones go back to the system, where malloc's default would keep them. (The
setting's default, which needs no process, is tested in `tests/unit/test_allocator.py`.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_pipeline.train.allocator import CACHE_VARIABLES

PROBE = """
import sys, torch
from relax_pipeline.train.allocator import keep_freed_cpu_memory
kept = keep_freed_cpu_memory() if sys.argv[1] == "keep" else None
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
before = rss_mib()
big = torch.ones(64 << 20)  # 256 MiB of float32, touched
del big
print(kept, round(rss_mib() - before))
"""


BOUND_PROBE = """
import sys, torch
from relax_pipeline.train.allocator import bound_cpu_memory
bound = bound_cpu_memory() if sys.argv[1] == "bound" else None
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
first = torch.ones(2 << 20)
del first  # a freed 8 MiB chunk: malloc's own threshold rises past 8 MiB
before = rss_mib()
pairs = [(torch.ones(2 << 20), torch.ones(16 << 10)) for _ in range(32)]  # 8 MiB each, a small one between
small = [s for _, s in pairs]
del pairs
print(bound, round(rss_mib() - before))
"""


def resident_after_free(mode: str, probe: str = PROBE) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}  # an in-process run may have set them
    out = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, check=True, env=env)
    kept, grown = out.stdout.split()
    return kept, int(grown)


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or sys.platform != "linux", reason="reads /proc (Linux)")
def test_freed_buffers_stay_mapped_only_when_asked() -> None:
    kept, grown = resident_after_free("keep")
    assert kept == "True" and grown >= 200, f"the freed 256 MiB should stay resident for reuse (grew {grown} MiB)"
    _, grown = resident_after_free("default")
    assert grown < 64, f"by default malloc unmaps a freed 256 MiB buffer (grew {grown} MiB)"



@pytest.mark.skipif(not Path("/proc/self/statm").exists() or sys.platform != "linux", reason="reads /proc (Linux)")
def test_bounded_memory_returns_freed_mid_sized_chunks() -> None:
    bound, grown = resident_after_free("bound", BOUND_PROBE)
    assert bound == "True" and grown < 64, f"bounded: freed 8 MiB chunks go back to the system (grew {grown} MiB)"
    _, grown = resident_after_free("default", BOUND_PROBE)
    assert grown >= 200, f"by default the heap keeps 8 MiB chunks between live small ones (grew {grown} MiB)"


KERNEL_PROBE = """
import sys
from relax_pipeline.train.allocator import cap_kernel_cache
capped = cap_kernel_cache() if sys.argv[1] == "cap" else None
import torch
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
weight, rows = torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(600, 512, dtype=torch.bfloat16)
torch.nn.functional.linear(rows[:1], weight)
before = rss_mib()
for count in range(1, 601):  # a bf16 matmul of 600 shapes: oneDNN compiles a kernel for each
    torch.nn.functional.linear(rows[:count], weight)
print(capped, round(rss_mib() - before))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or sys.platform != "linux", reason="reads /proc (Linux)")
def test_capped_kernel_cache_keeps_fewer_kernels() -> None:
    capped, grown_capped = resident_after_free("cap", KERNEL_PROBE)
    _, grown = resident_after_free("default", KERNEL_PROBE)
    assert capped == "True" and grown - grown_capped >= 50, (
        f"oneDNN's and ideep's caches keep 1,024 each by default (grew {grown} MiB), capped at 64 ({grown_capped} MiB)")


RELEASE_PROBE = """
import sys, torch
from relax_pipeline.train.allocator import keep_freed_cpu_memory, release_freed_memory
keep_freed_cpu_memory()
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
before = rss_mib()
big = torch.ones(64 << 20)  # 256 MiB of float32, touched, then freed into the kept heap
del big
kept = rss_mib() - before
released = release_freed_memory() if sys.argv[1] == "release" else None
print(released, round(kept - (rss_mib() - before)))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or sys.platform != "linux", reason="reads /proc (Linux)")
def test_release_hands_the_kept_heap_back_once_asked() -> None:
    released, returned = resident_after_free("release", RELEASE_PROBE)
    assert released == "True" and returned >= 200, f"the kept 256 MiB should go back to the system ({returned} MiB)"
    _, returned = resident_after_free("keep", RELEASE_PROBE)
    assert returned < 16, f"without the release the kept heap stays resident ({returned} MiB returned)"
