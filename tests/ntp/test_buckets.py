"""Gradient buckets are cut identically on every rank, whatever each rank's shard holds."""

from __future__ import annotations

import pytest
import torch

from ntp.grad_sync import DEFAULT_BUCKET_ELEMENTS, bucket_parameters
from ntp.model import FLAVORS, Transformer
from ntp.parallelize import apply_ntp
from tessera_core.plan import plan_job


def bucket_names_per_rank(
    flavor: str, degrees: list[int], cap: int
) -> tuple[list[str], list[list[list[str]]]]:
    """The model's parameter names and, per rank of the job, its buckets' parameter names."""
    args = FLAVORS[flavor]
    shape = args.shape()
    job = plan_job(shape, degrees, global_batch=2 * sum(degrees))
    out = []
    for replica in job.replicas:
        for shard in replica.shards:
            with torch.device("meta"):  # shapes only: the 8B flavor is never materialized
                model = Transformer(args)
            apply_ntp(model, shard, group=None)
            local = list(model.named_parameters())
            out.append([[n for n, _ in b] for b in bucket_parameters(local, shape, cap)])
    return [n for n, _ in local], out


@pytest.mark.parametrize(
    ("flavor", "degrees", "cap"),
    [
        ("debug", [4, 3], 3500),  # between the local sizes of different ranks' layer groups
        ("debug", [5, 2], 2000),
        ("llama3-8b", [8, 4], DEFAULT_BUCKET_ELEMENTS),
    ],
)
def test_every_rank_cuts_the_same_buckets(flavor, degrees, cap):
    params, per_rank = bucket_names_per_rank(flavor, degrees, cap)
    assert all(buckets == per_rank[0] for buckets in per_rank)
    assert len(per_rank[0]) > 1  # the cap actually splits the model
    # Every parameter in exactly one bucket, the LM head's first (backward starts there).
    names = [n for b in per_rank[0] for n in b]
    assert sorted(names) == sorted(params)
    assert names[0] == "output.weight" and names[-1] == "tok_embeddings.weight"
