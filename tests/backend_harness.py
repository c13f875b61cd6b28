"""The ``backend`` fixture's object: how a conformance test builds stubs and tensors on one framework.

Frameworks are imported here directly: a test that needs one must fail, not skip, when it is missing.
"""

import numpy as np
import pytest

# the backend parameter of a test whose MindSpore case takes 5 s and more on 2 cores: that case runs in the
# whole suite (slow), the torch one in the fast loop too
SLOW_ON_MINDSPORE = ["torch", pytest.param("mindspore", marks=pytest.mark.slow)]


class TorchHarness:
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def stub(self, dtype="float32", **kwargs):
        from stub_torch import TorchStubLM

        return TorchStubLM(dtype=getattr(self.torch, dtype), **kwargs)

    def tensor(self, array, dtype="int64"):
        return self.torch.from_numpy(np.asarray(array).astype(dtype))

    def numpy(self, tensor):
        return tensor.detach().cpu().numpy()

    def is_native(self, tensor):
        return isinstance(tensor, self.torch.Tensor)

    def int64(self, tensor):
        return tensor.dtype == self.torch.int64

    def manual_seed(self, seed):
        self.torch.manual_seed(seed)


class MindSporeHarness:
    name = "mindspore"

    def __init__(self):
        import mindspore

        from hyper_gen.backends.mindspore import configure

        configure("CPU")
        self.ms = mindspore

    def stub(self, dtype="float32", **kwargs):
        from stub_mindspore import MindSporeStubLM

        return MindSporeStubLM(dtype=getattr(self.ms, dtype), **kwargs)

    def tensor(self, array, dtype="int64"):
        return self.ms.Tensor(np.asarray(array).astype(dtype))

    def numpy(self, tensor):
        return tensor.asnumpy()

    def is_native(self, tensor):
        return isinstance(tensor, self.ms.Tensor)

    def int64(self, tensor):
        return tensor.dtype == self.ms.int64

    def manual_seed(self, seed):
        self.ms.set_seed(seed)


HARNESSES = {"torch": TorchHarness, "mindspore": MindSporeHarness}
