"""oal.kernels.base.derived: a kernel's coefficients remembered while its parameters are unchanged, rebuilt when
they change (in place, replaced), never remembered under autograd; the kernels that use it follow a change."""

from __future__ import annotations

import torch

from oal.kernels import ExactHeadsKernel, OALKernel, SinkWindowKernel
from oal.kernels.base import derived


def test_remembered_until_a_tensor_changes():
    m = torch.nn.Linear(2, 2)
    builds = []

    def build():
        builds.append(1)
        return m.weight.sum()

    with torch.no_grad():
        first = derived(m, "s", (m.weight,), build)
        assert derived(m, "s", (m.weight,), build) is first and len(builds) == 1
        m.weight.add_(1.0)  # in place: a new version
        assert torch.allclose(derived(m, "s", (m.weight,), build), first + 4) and len(builds) == 2
        m.weight = torch.nn.Parameter(torch.zeros(2, 2))  # replaced: another storage
        assert derived(m, "s", (m.weight,), build) == 0 and len(builds) == 3
        derived(m, "s", (m.weight,), build, extra=(0.5,))  # another extra value
        assert len(builds) == 4


def test_not_remembered_under_autograd_or_for_inference_tensors():
    m = torch.nn.Linear(2, 2)
    calls = []
    out = derived(m, "s", (m.weight,), lambda: calls.append(1) or m.weight.sum())
    assert out.requires_grad
    derived(m, "s", (m.weight,), lambda: calls.append(1) or m.weight.sum())
    assert len(calls) == 2 and "_oal_derived" not in m.__dict__
    with torch.inference_mode():
        t = torch.ones(3)
        derived(m, "t", (t,), lambda: calls.append(1))
        derived(m, "t", (t,), lambda: calls.append(1))
    assert len(calls) == 4


def test_kernels_follow_a_parameter_changed_in_place():
    torch.manual_seed(0)
    oal = OALKernel(torch.randint(0, 3, (6, 8)), 3, L=torch.randn(6, 4, 4) * 0.4)
    sw = SinkWindowKernel(oal, n_sink=2, window=5, beta=torch.randn(6) * 0.3)
    q, k, v = (torch.randn(1, h, 40, 8) for h in (6, 3, 3))
    for kernel in (sw, ExactHeadsKernel(sw, [1])):
        with torch.no_grad():
            before, _ = kernel(q, k, v)
            assert torch.equal(kernel(q, k, v)[0], before)
            oal.L.mul_(1.5)
            sw.beta.add_(0.5)
            after, _ = kernel(q, k, v)
            assert not torch.allclose(after, before)
        torch.testing.assert_close(after, kernel(q, k, v)[0].detach())  # autograd path: built anew
