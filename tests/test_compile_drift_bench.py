"""benchmarks/compile_drift.py: the table's cells and the seeded perturbations (the measurements
themselves are results files: compile_drift_*_cpu_<date>.md)."""

from __future__ import annotations

import torch

from scripts import load_benchmark

drift = load_benchmark("compile_drift")


def test_cells_give_one_value_or_the_seeds_median_and_count_near_whole():
    assert drift._cell([4.03e-2], 4.03e-2) == "4.03e-02"
    cell = drift._cell([1e-7, 1.3e-3, 4.0e-2, 4.0e-2, 4.1e-2], 4.03e-2)
    assert cell == "4.00e-02, 3/5 >= whole/2"
    assert drift._cell([1e-7, 2e-7, 3e-7], None) == "2.00e-07"


class _Embedded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.emb


def test_perturbations_differ_by_seed_and_stay_float32_sized():
    model = _Embedded()
    base = model.emb.weight.detach().clone()
    a = drift.variant(model, "perturbed", 23, seed=1).emb.weight.detach()
    b = drift.variant(model, "perturbed", 23, seed=2).emb.weight.detach()
    assert not torch.equal(a, b) and not torch.equal(a, base)
    ulp = torch.nextafter(base.abs(), torch.tensor(float("inf"))) - base.abs()
    assert ((a - base).abs() <= 2 * ulp).all()  # a relative 2^-23: two units in the last place
    assert torch.equal(drift.variant(model, "perturbed", 23, seed=1).emb.weight, a)
