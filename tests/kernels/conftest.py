import pytest
import torch


@pytest.fixture(autouse=True)
def two_threads():
    """Two intra-op threads for every kernel test, whatever the pytest worker has.

    .ci/run gives each worker one thread, but the C++ kernels split sequences, heads and split-KV
    segments across torch's threads: a partition or merge bug shows only when there are two, so the
    kernel-vs-reference tests run there. They are small; the oversubscription costs seconds.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
