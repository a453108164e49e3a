"""Layout rules: first-match semantics, the fast resolver, and every error."""

import random
import re

import pytest

from layout_core.errors import ConfigError
from layout_core.layout.scope import plan_layouts, report_unused_rules
from layout_core.model.lm import transformer_lm_params
from layout_core.layout.rules import LayoutRules, naive_first_match

AXES = {'data': 2, 'model': 4}


def test_exact_key_then_first_regex_then_replicated():
  rules = LayoutRules([
      (r'.*/w', ('model', 'unsharded')),
      (r'lm/block_000/w', ('unsharded', 'model')),  # exact: beats the earlier regex
      (r'lm/.*', ('data', 'unsharded')),
  ])
  assert rules.match('lm/block_000/w') == 1
  assert rules.match('lm/block_001/w') == 0
  assert rules.match('lm/block_001/b') == 2
  assert rules.match('other/b') is None
  assert rules.resolve('other/b', (3,), AXES).spec == ('unsharded',)


def test_fullmatch_not_prefix_match():
  rules = LayoutRules([(r'lm/emb', ('model',))])
  assert rules.match('lm/emb') == 0
  assert rules.match('lm/emb/table') is None


def test_fast_resolver_agrees_with_naive_loop():
  rng = random.Random(0)
  modules = ['attn/wq', 'attn/wo', 'ffn/w_in', 'ffn/b_in', 'ln/scale', 'emb/table']
  paths = [f'lm{t}/stack/block_{i:03d}/{m}' for t in range(3) for i in range(40)
           for m in modules]
  patterns = [r'.*/attn/w[qkv]', r'lm1/.*', r'.*/block_00[0-4]/.*', r'.*block_\d*7/ffn/.*',
              r'lm(\d)/stack/block_0\1.*', r'(?P<x>lm2)/.*/w_in', r'.*/ffn/b_.*',
              r'.*/(attn|ffn)/w.*', r'[a-z]+0/.*/ln/scale', r'lm[^1]/.*/emb/table',
              r'.*block_01\d/.*', r'.*[13579]/attn/.*', r'(?i)LM0/.*/W_IN',
              r'^lm2/stack/.*ln/scale$', r'lm0/stack/block_000/attn/wq|.*/emb/table',
              r'lm1/stack/block_0(1)?\d\d/ffn/w_in', r'lm0/stack/block_001/ffn/b_in',
              r'.*/ffn/(w_in)?.*', r'lm2/stack/block_03[5-9]/attn/wo']
  for trial in range(20):
    chosen = rng.sample(patterns, rng.randint(1, len(patterns)))
    rules = LayoutRules([(p, ('unsharded',)) for p in chosen])
    compiled = [re.compile(p) for p in chosen]
    assert rules.match_many(paths) == [naive_first_match(compiled, p) for p in paths], chosen


def test_rank_mismatch_names_variable_rank_and_rule():
  rules = LayoutRules([(r'.*/w_in', ('model',))])
  with pytest.raises(ConfigError) as e:
    rules.resolve('lm/ffn/w_in', (64, 256), AXES)
  message = str(e.value)
  assert "'lm/ffn/w_in'" in message and 'rank 2' in message and "rule 0 ('.*/w_in'" in message


def test_unknown_axis_lists_the_mesh_axes():
  rules = LayoutRules([(r'.*', ('modle', 'unsharded'))])
  with pytest.raises(ConfigError, match=r"'modle'.*\['data', 'model'\]"):
    rules.check_mesh(AXES)


def test_not_divisible_prints_both_numbers():
  rules = LayoutRules([(r'.*/w', ('unsharded', 'model'))])
  with pytest.raises(ConfigError, match=r"dim 1 has size 6, not divisible by mesh axis 'model' of size 4"):
    rules.resolve('lm/w', (8, 6), AXES)


def test_same_axis_twice_is_rejected():
  with pytest.raises(ConfigError, match="shards over axis 'model' twice"):
    LayoutRules([(r'.*', ('model', 'model'))]).check_mesh(AXES)


def test_invalid_regex_prints_the_rule():
  with pytest.raises(ConfigError, match=r"rule 1 \('lm/\(oops'.*not a valid regex"):
    LayoutRules([(r'.*', ('model',)), (r'lm/(oops', ('model',))])


def test_malformed_rule_entry():
  with pytest.raises(ConfigError, match='layout rule 0'):
    LayoutRules(['.*'])


def test_unused_rules_warn_or_fail_when_strict():
  lm = transformer_lm_params(num_layers=1)
  specs = lm.cls.variable_specs(lm)
  lenient = LayoutRules([(r'.*/ffn/w_in', ('unsharded', 'model')), (r'.*/nothing', ('model',))])
  records = plan_layouts(specs, lenient, AXES)
  assert [r.index for r in lenient.unused_rules(r.rule_index for r in records)] == [1]
  assert lenient.match_counts(r.rule_index for r in records) == [1, 0]
  report_unused_rules(lenient, records)  # a warning only
  strict = LayoutRules([(r'.*/nothing', ('model',))], strict=True)
  records = plan_layouts(specs, strict, AXES)
  with pytest.raises(ConfigError, match=r"1 layout rule\(s\) matched no variable: rule 0 \('.\*/nothing'"):
    report_unused_rules(strict, records)


def test_plan_bytes_per_device_is_total_over_shards():
  lm = transformer_lm_params(num_layers=1, model_dim=64, ffn_dim=256)
  rules = LayoutRules([(r'.*/ffn/w_in', ('data', 'model'))])
  records = {r.path: r for r in plan_layouts(lm.cls.variable_specs(lm), rules, AXES)}
  w_in = records['lm/stack/block/ffn/w_in']  # repeat=1 keeps the child's own name
  assert w_in.spec == ('data', 'model') and w_in.source == '0: .*/ffn/w_in'
  assert w_in.bytes_per_device == w_in.bytes_total // 8 == 64 * 256 * 4 // 8
  ln = records['lm/final_ln/scale']
  assert ln.bytes_per_device == ln.bytes_total and ln.source == 'default: replicated'


def test_a_rule_whose_variables_all_went_to_earlier_rules_is_shadowed():
  lm = transformer_lm_params(num_layers=2)
  rules = LayoutRules([(r'.*/ffn/w_in', ('unsharded', 'model')),
                       (r'.*/ffn/w_out', ('model', 'unsharded')),
                       (r'.*/ffn/w_(in|out)', ('model', 'unsharded')),  # shadowed by 0 and 1
                       (r'.*/ffn/b_.*', ('unsharded',)),                # partly shadowed: used
                       (r'.*/ffn/b_in', ('model',)),                    # shadowed by 3
                       (r'.*/nothing', ('model',))])                    # fits nothing
  records = plan_layouts(lm.cls.variable_specs(lm), rules, AXES)
  paths = [r.path for r in records]
  uses = rules.rule_uses(paths, [r.rule_index for r in records])
  # Reference: try every rule on every path, first match wins (naive_first_match).
  compiled = [re.compile(r.pattern) for r in rules.rules]
  winners = [naive_first_match(compiled, p) for p in paths]
  for use, pattern in zip(uses, compiled):
    fitted = [w for p, w in zip(paths, winners) if pattern.fullmatch(p)]
    assert use.matched == winners.count(use.rule.index)
    assert use.shadowed == (use.matched == 0 and bool(fitted))
    if use.unused:
      assert (use.fits, use.shadowed_by) == (len(fitted), tuple(sorted(set(fitted))))
  assert [(u.matched, u.unused, u.shadowed) for u in uses] == [
      (2, False, False), (2, False, False), (0, True, True), (4, False, False),
      (0, True, True), (0, True, False)]
  assert uses[2].shadowed_by == (0, 1) and uses[4].shadowed_by == (3,)
  assert uses[2].describe() == ('shadowed: the 4 variable(s) it fits were taken by '
                                'rule 0, rule 1')
  assert uses[5].describe() == 'matched nothing'
