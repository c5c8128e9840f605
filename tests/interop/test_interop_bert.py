"""BERT (tfjax.interop.families.bert) against transformers: masked-LM and classifier logits,
TF-era key names, round trips, and refusals."""

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical
from interop_references import ATOL, apply, padded_batch, torch, transformers

from tfjax import interop

bert_mlm = references.bert_mlm


@references.reference
def bert_cls():
    torch.manual_seed(3)
    return transformers.BertForSequenceClassification(references.bert_config()).eval()


@pytest.mark.parametrize("scan_layers", [False, True])
def test_mlm_logits_match_reference(bert_mlm, scan_layers):
    ref, path = bert_mlm
    model, params = interop.load(path, scan_layers=scan_layers)
    assert model.head == "mlm" and model.norm_eps == 1e-12
    tokens, mask = padded_batch()
    with torch.no_grad():
        want = ref(
            torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))
        ).logits.numpy()
    got = apply(model, params, jnp.asarray(tokens))
    # Padded query rows differ by design (tfjax masks them fully); real tokens must agree.
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)


def test_classifier_logits_match_reference(bert_cls):
    ref, path = bert_cls
    model, params = interop.load(path)
    assert model.head == "classifier" and model.num_classes == 3
    tokens, mask = padded_batch()
    types = (np.arange(10) >= 4).astype(np.int64)[None].repeat(2, 0)
    with torch.no_grad():
        want = ref(
            torch.tensor(tokens),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            token_type_ids=torch.tensor(types),
        ).logits.numpy()
    got = apply(model, params, jnp.asarray(tokens), token_types=jnp.asarray(types))
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_reads_tf_era_gamma_beta_names(bert_mlm):
    ref, path = bert_mlm
    state = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in ref.state_dict().items()
    }
    _, renamed = interop.from_bert(state, interop.read_config(path))
    _, direct = interop.load(path)
    assert_params_identical(renamed, direct)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", ["bert_mlm", "bert_cls"])
def test_round_trip_through_safetensors_is_bitwise(family, scan_layers, request, tmp_path):
    references.check_round_trip(request.getfixturevalue(family)[1], scan_layers, tmp_path)


def test_exported_checkpoint_loads_in_transformers(bert_cls, tmp_path):
    references.check_transformers_reads_export(*bert_cls, tmp_path)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        (
            "bert_mlm",
            {"hidden_act": "relu"},
            r"BertForMaskedLM: hidden_act='relu' is not supported; allowed: \('gelu',\) "
            r"\(the masked-LM head",
        ),
        (
            "bert_cls",
            {"position_embedding_type": "relative_key"},
            r"position_embedding_type='relative_key' is not supported \(needs 'absolute'\)",
        ),
        ("bert_cls", {"is_decoder": True}, r"is_decoder=True is not supported"),
    ],
)
def test_config_values_tfjax_lacks_are_errors(family, changes, message, request):
    """Each refusal names the key, its value and what tfjax supports."""
    references.check_config_refused(request.getfixturevalue(family)[1], changes, message)
