"""peat.models: the training step's loss and counts."""
import torch

from peat import models


class Logits(torch.nn.Module):
    """A model whose logits are its input."""

    def forward(self, x):
        return x


def _metrics(logits, labels):
    return models.loss_and_metrics(Logits(), "image", torch.tensor(logits), torch.tensor(labels))


def test_a_finite_batch_counts_argmax_as_before():
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(1))
    loss, metrics = _metrics(logits.tolist(), labels.tolist())
    assert metrics == {"correct": int((logits.argmax(-1) == labels).sum()), "count": 64}
    assert torch.equal(loss, torch.nn.functional.cross_entropy(logits, labels))


def test_rows_whose_largest_logit_is_not_finite_count_as_wrong_and_a_minus_inf_elsewhere_does_not():
    # A NaN, +inf or an all -inf row predicts nothing; one -inf logit (an impossible class) leaves the
    # argmax of the others a prediction: with the loss finite, it counted as wrong (the isfinite pass).
    nan, inf = float("nan"), float("inf")
    loss, metrics = _metrics([[nan, 0.0], [-inf, -inf], [0.0, inf], [2.0, -inf]], [0, 0, 1, 0])
    assert metrics == {"correct": 1, "count": 4} and not loss.isfinite()  # only the last
    loss, metrics = _metrics([[2.0, -inf, 1.0], [-inf, 0.0, 1.0]], [0, 2])
    assert metrics == {"correct": 2, "count": 2} and loss.isfinite()


def test_text_kinds_count_each_token():
    class LM(torch.nn.Module):
        def forward(self, input_ids):
            logits = torch.nn.functional.one_hot(input_ids, 4).float()
            logits[0, 0, 0] = float("nan")
            return type("Out", (), {"logits": logits})

    ids = torch.tensor([[1, 2, 3], [3, 2, 1]], dtype=torch.uint8)
    loss, metrics = models.loss_and_metrics(LM(), "text", ids, ids)
    assert metrics == {"correct": 5, "count": 6} and loss.isnan()
