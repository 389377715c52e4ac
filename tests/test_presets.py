"Values typed one way: `presets.convert_field` by the dataclass field's annotation, for presets, the command line and bench; the presets' errors."
from dataclasses import dataclass

import pytest

from transject_nb.core import EncoderConfig, variant_spec
from transject_nb.training.utils import split_choices
from transject_nb.presets import PRESET_KINDS, PRESET_SECTIONS, TASKS, convert_field, field_owners, load_preset, preset_section
from transject_nb.training.config import DataConfig, TrainConfig, preset_configs


@dataclass
class _Cfg:
    n:int = 1
    x:float = 0.5
    k:int|None = None
    on:bool = False
    name:str = 'a'
    shape:tuple = (1, 2)


def test_convert_field_types_by_annotation():
    assert convert_field(_Cfg, 'n', ' 3 ') == 3 and type(convert_field(_Cfg, 'x', '2')) is float
    assert convert_field(_Cfg, 'k', 'None') is None and convert_field(_Cfg, 'k', '4') == 4
    assert convert_field(_Cfg, 'on', 'yes') is True and convert_field(_Cfg, 'on', 'off') is False
    assert convert_field(_Cfg, 'name', 'none') == 'none'                    # str only: 'none' is text, not None
    with pytest.raises(ValueError, match=r"^n: expected int, got '2\.5'$"): convert_field(_Cfg, 'n', '2.5')
    with pytest.raises(ValueError, match=r"--k: expected int\|None, got 'many'"): convert_field(_Cfg, 'k', 'many', where='--k')
    with pytest.raises(ValueError, match="expected bool, got 'maybe'"): convert_field(_Cfg, 'on', 'maybe')
    with pytest.raises(ValueError, match="_Cfg: unknown field 'm'; valid fields are: n, x, k"): convert_field(_Cfg, 'm', '1')
    with pytest.raises(TypeError, match='_Cfg.shape is annotated'): convert_field(_Cfg, 'shape', '1,2')


def test_field_owners_first_wins():
    tj, sm = variant_spec('transject').config_cls, variant_spec('transformer').config_cls      # both have d_model
    assert field_owners([tj, sm])['d_model'] is tj and field_owners([sm, tj])['d_model'] is sm
    assert field_owners([tj, sm])['n_heads'] is sm                          # only the second has it
    owners = field_owners([TrainConfig, DataConfig])
    assert owners['eps'] is TrainConfig and owners['n_train'] is DataConfig and 'd_model' not in owners
    assert preset_configs()[:2] == (TrainConfig, DataConfig)


def test_split_choices():
    assert split_choices('imdb,listops', TASKS, 'task') == ['imdb', 'listops'] and split_choices(None, TASKS, 'task') == list(TASKS)
    with pytest.raises(ValueError, match="unknown task 'sst2'; valid tasks are: imdb, agnews, listops, charimdb"): split_choices('sst2', TASKS, 'task')


def test_every_shipped_section_loads_typed():
    configs = preset_configs()
    for t in TASKS:
        for k in PRESET_KINDS:
            p = load_preset(t, k, configs=configs)
            assert type(p['epochs']) is int and type(p['lr']) is float and type(p['max_len']) is int, preset_section(t, k)
    assert len(PRESET_SECTIONS) == len(TASKS) * len(PRESET_KINDS)


def test_preset_errors_name_section_key_text_and_type(tmp_path):
    configs = preset_configs()
    (tmp_path/'a.ini').write_text("[imdb-cpu]\nepochs = three\n")
    with pytest.raises(ValueError, match=r"a\.ini \[imdb-cpu\] epochs: expected int, got 'three'"): load_preset('imdb', 'cpu', tmp_path/'a.ini', configs=configs)
    (tmp_path/'b.ini').write_text("[DEFAULT]\nn_train = lots\n")
    with pytest.raises(ValueError, match=r"b\.ini \[DEFAULT\] n_train: expected int\|None, got 'lots'"): load_preset('imdb', path=tmp_path/'b.ini', configs=configs)
    (tmp_path/'c.ini').write_text("[listops]\nlearning_rate = 1e-3\n")
    with pytest.raises(ValueError, match=r"c\.ini \[listops\]: unknown key 'learning_rate'; valid keys are: lr, beta1, "): load_preset('listops', path=tmp_path/'c.ini', configs=configs)
    assert 'learning_rate' not in load_preset('listops', path=tmp_path/'c.ini', configs=configs, strict=False)
    (tmp_path/'d.ini').write_text("[listops]\nepochs = 7\n[DEFAULT]\nepochs = 5\nbs = 8\n")
    p = load_preset('listops', path=tmp_path/'d.ini', configs=configs)
    assert (p['epochs'], p['bs'], p['lr']) == (7, 8, 5e-4)                  # the section beats its file's [DEFAULT]; the rest stays shipped
    with pytest.raises(ValueError, match=r"\[DEFAULT\]: unknown key 'n_experts'"): load_preset('imdb', configs=[EncoderConfig])
    with pytest.raises(TypeError, match='configs'): load_preset('imdb')     # the dataclasses are always named
