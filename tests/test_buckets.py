import pytest
import torch

from lockstep.moe.buckets import bucketize, flatten_bucket, tensor_bytes, unflatten_bucket


def test_bucketize_bounds_each_bucket_and_keeps_order():
    named = [(f"w{i}", torch.randn(10 * (i + 1))) for i in range(6)]  # 40..240 bytes
    buckets = list(bucketize(named, 300))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    for b in buckets:
        assert len(b) == 1 or sum(tensor_bytes(t) for _, t in b) <= 300
    big = list(bucketize([("big", torch.zeros(1000))], 16))
    assert len(big) == 1 and big[0][0][0] == "big"
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucketize(named, 0))


def test_flatten_roundtrip_mixed_dtypes():
    bucket = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.int64)),
              ("c", torch.randn(2, 2, 2).to(torch.bfloat16))]
    flat, names, dtypes, shapes = flatten_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(tensor_bytes(t) for _, t in bucket)
    back = unflatten_bucket(flat, names, dtypes, shapes)
    for (n0, t0), (n1, t1) in zip(bucket, back):
        assert n0 == n1 and t0.dtype == t1.dtype and torch.equal(t0, t1)
    with pytest.raises(ValueError, match="bytes"):
        unflatten_bucket(flat[:-1], names, dtypes, shapes)
    with pytest.raises(ValueError, match="hold"):
        unflatten_bucket(torch.cat([flat, flat[:1]]), names, dtypes, shapes)
