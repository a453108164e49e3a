"""The Params tree: definition, dotted set, copy, freeze, text dump and diff."""

import pytest

from layout_core import model
from layout_core.errors import ConfigError
from layout_core.params import Params


def make():
  p = Params()
  p.Define('name', 'ffn', 'Layer name.')
  p.Define('hidden_dim', 256, 'Inner width.')
  inner = Params()
  inner.Define('rate', 0.1, 'Dropout rate.')
  p.Define('dropout', inner, 'Nested params.')
  return p


def test_define_get_set_and_dotted_set():
  p = make()
  assert p.hidden_dim == 256
  p.hidden_dim = 512
  p.Set(**{'dropout.rate': 0.3}, name='x')
  p.Set(dropout__rate=0.4)
  assert (p.hidden_dim, p.name, p.dropout.rate) == (512, 'x', 0.4)
  assert p.Get('dropout.rate') == 0.4
  assert p.Doc('hidden_dim') == 'Inner width.'
  with pytest.raises(ConfigError, match='already defined'):
    p.Define('name', 'y', 'again')


def test_did_you_mean_on_misspelt_keys():
  p = make()
  with pytest.raises(AttributeError, match="did you mean 'hidden_dim'"):
    _ = p.hidden_dmi
  with pytest.raises(ConfigError, match="did you mean 'hidden_dim'"):
    p.hiden_dim = 3
  with pytest.raises(ConfigError, match="did you mean 'rate'"):
    p.Set(**{'dropout.rat': 1})
  assert not hasattr(p, 'nonsense')


def test_copy_is_deep_and_freeze_is_recursive():
  p = make()
  q = p.Copy()
  q.dropout.rate = 0.9
  assert p.dropout.rate == 0.1
  p.Freeze()
  assert p.IsFrozen() and p.dropout.IsFrozen()
  with pytest.raises(ConfigError, match='frozen'):
    p.hidden_dim = 1
  with pytest.raises(ConfigError, match='frozen'):
    p.dropout.rate = 1
  thawed = p.Copy()
  thawed.hidden_dim = 1
  assert not thawed.IsFrozen() and thawed.hidden_dim == 1


def test_text_dump_and_diff():
  p = make()
  assert p.ToText() == ("dropout.rate : 0.1\nhidden_dim : 256\nname : 'ffn'\n")
  q = p.Copy().Set(hidden_dim=512)
  assert p.TextDiff(q) == '- hidden_dim : 256\n+ hidden_dim : 512\n'
  assert p.TextDiff(p.Copy()) == ''
  assert p == p.Copy() and p != q


def test_lists_of_params_are_flattened_and_addressable():
  lm = model.transformer_lm_params(num_layers=3)
  text = lm.ToText()
  assert 'sub[1].repeat : 3\n' in text
  assert 'sub[1].sub[0].ffn_dim : 256\n' in text
  lm.Set(**{'sub[1].sub[0].ffn_dim': 128})
  assert lm.sub[1].sub[0].ffn_dim == 128


def test_instantiate_builds_the_named_class_at_its_path():
  p = model.FeedForward.Params().Set(input_dim=4, hidden_dim=8)
  ffn = p.Instantiate(parent_path='net')
  assert isinstance(ffn, model.FeedForward)
  assert ffn.path == 'net/ffn' and ffn.w_in.shape == (4, 8)
  assert ffn.params.IsFrozen() and not p.IsFrozen()
  with pytest.raises(ConfigError, match='no cls'):
    make().Instantiate()
