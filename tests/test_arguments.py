"""One source for the arguments: ``ZeroPPConfig`` defines each one (type, default, check, doc), and both front doors'
signatures and docstrings, LightningCLI's view of them and the docs' table follow from it; adding a field is all
it takes. Also: building a strategy from a config, and the deprecated spellings."""

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from lightning_zeropp import ZeroPPConfig
from lightning_zeropp import ZeroPPStrategy as TrainerStrategy
from lightning_zeropp.argument_table import PAGE, TABLE_END, TABLE_START, table, write_table
from lightning_zeropp.config import RENAMED, PositiveInt, argument
from lightning_zeropp.fabric import FabricArguments
from lightning_zeropp.fabric import ZeroPPStrategy as FabricStrategy

pytestmark = pytest.mark.version_sensitive

try:
    from jsonargparse import ArgumentParser
except ImportError:  # the oldest-versions run installs torch, Lightning and pytest only
    ArgumentParser = None
needs_cli = pytest.mark.skipif(ArgumentParser is None, reason="jsonargparse (the cli and test extras) is not installed")

ARGUMENTS_PAGE = Path(__file__).resolve().parents[1] / PAGE
FRONT_DOORS = [TrainerStrategy, FabricStrategy]


def _check_knob(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ZeroPPStrategy: `{name}={value!r}` is not allowed; use a positive int.")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ExtendedConfig(ZeroPPConfig):
    """The config with one field more, defined as any field of ZeroPPConfig is."""

    extra_knob: PositiveInt = argument(3, "A knob only this test has, turned a number of times.", check=_check_knob)


class ExtendedTrainerStrategy(TrainerStrategy, config=ExtendedConfig):
    pass


class ExtendedFabricStrategy(FabricStrategy, config=ExtendedConfig):
    pass


def _words(text: str) -> str:
    return " ".join(text.split())


def _leaves(hint) -> list[str]:
    """The names a type is built of, as a help text shows them whatever its union notation: classes and literals."""
    if typing.get_origin(hint) is typing.Literal:
        return [repr(a) for a in typing.get_args(hint)]
    if isinstance(hint, list):  # a Callable's parameters
        return [name for h in hint for name in _leaves(h)]
    if typing.get_args(hint):
        return [name for h in typing.get_args(hint) for name in _leaves(h)]
    return ["null" if hint is type(None) else hint.__name__]


def _cli_help(strategy_class, monkeypatch) -> dict[str, str]:
    """LightningCLI's (jsonargparse's) help of each argument of a strategy class, whitespace collapsed."""
    monkeypatch.setenv("COLUMNS", "100000")  # one line per argument: argparse would break words at hyphens
    parser = ArgumentParser()
    parser.add_class_arguments(strategy_class, "s")
    blocks = {}
    for block in _words(parser.format_help()).split(" --s.")[1:]:
        name = block.split()[0].rstrip("+")  # a list argument is listed twice, "name" then "name+" (append)
        blocks[name] = block  # the last one holds the help
    return blocks


@pytest.mark.parametrize("config_class", [ZeroPPConfig, ExtendedConfig])
@pytest.mark.parametrize("front_door", ["Trainer", "Fabric"])
def test_signature_and_docstring_come_from_the_config(config_class, front_door):
    strategy = {
        (ZeroPPConfig, "Trainer"): TrainerStrategy,
        (ZeroPPConfig, "Fabric"): FabricStrategy,
        (ExtendedConfig, "Trainer"): ExtendedTrainerStrategy,
        (ExtendedConfig, "Fabric"): ExtendedFabricStrategy,
    }[(config_class, front_door)]
    params = dict(inspect.signature(strategy.__init__).parameters)
    assert params.pop("self")
    hints = typing.get_type_hints(config_class)
    doc = _words(strategy.__doc__)
    config_fields = dataclasses.fields(config_class)
    for f in config_fields:
        p = params.pop(f.name)
        assert (p.annotation, p.default) == (hints[f.name], f.default), f.name
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert _words(f"{f.name}: {f.metadata['doc']}") in doc, f.name
    for old in RENAMED:  # deprecated spellings are taken by name (with a warning), never shown
        assert old not in params and f"{old}:" not in doc, old
    if front_door == "Fabric":
        p = params.pop("parallelize_fn")
        assert p.default is None and p.kind is inspect.Parameter.KEYWORD_ONLY
        assert _words(dataclasses.fields(FabricArguments)[0].metadata["doc"]) in doc
    assert params == {}
    assert doc.index("Arguments:") > 0 and strategy.__doc__.startswith("ZeRO++")
    assert ("extra_knob" in doc) is (config_class is ExtendedConfig)


@needs_cli
@pytest.mark.parametrize("strategy", [TrainerStrategy, FabricStrategy, ExtendedTrainerStrategy])
def test_cli_sees_each_argument_with_its_type_default_and_help(strategy, monkeypatch):
    helps = _cli_help(strategy, monkeypatch)
    defaults = ArgumentParser()
    defaults.add_class_arguments(strategy, "s")
    parsed = defaults.get_defaults().s
    for name, p in inspect.signature(strategy.__init__).parameters.items():
        if name in ("self", "parallelize_fn"):  # a callable: Fabric only, never from a YAML file
            continue
        text = helps[name]
        assert "(type: " in text, (name, text)
        shown = text[text.rindex("(type: ") :]
        for leaf in _leaves(p.annotation):
            assert leaf in shown or (leaf == "null" and "None" in shown), (name, leaf, shown)
        expected = None
        for f in dataclasses.fields(strategy.config_class):
            if f.name == name:
                expected = f.metadata["doc"]
        assert _words(expected) in text, (name, text)
        assert getattr(parsed, name) == p.default, name


@needs_cli
def test_cli_parses_and_refuses_a_new_field():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ExtendedTrainerStrategy, "s")
    strategy = ExtendedTrainerStrategy(**parser.parse_args(["--s.extra_knob", "7"]).s.as_dict())  # as LightningCLI
    assert strategy.zeropp_config.extra_knob == 7 and type(strategy.zeropp_config.extra_knob) is int
    with pytest.raises(Exception, match="extra_knob"):
        parser.parse_args(["--s.extra_knob", "0"])


@pytest.mark.parametrize("strategy", [ExtendedTrainerStrategy, ExtendedFabricStrategy])
def test_a_new_field_is_taken_checked_and_documented_by_both_front_doors(strategy):
    assert strategy(extra_knob=5).zeropp_config.extra_knob == 5
    assert strategy().zeropp_config == ExtendedConfig()
    config = ExtendedConfig(extra_knob=9, weight_bits=4)
    assert strategy.from_config(config).zeropp_config == config
    with pytest.raises(ValueError, match=r"`extra_knob=0` is not allowed; use a positive int"):
        strategy(extra_knob=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'extra_knob'"):
        strategy.__mro__[1](extra_knob=5)  # the front door of the plain config does not take it
    rows = table(ExtendedConfig).splitlines()
    row = "| `extra_knob` | `3` |  | A knob only this test has, turned a number of times. |"  # no "when" given
    assert row in rows
    # after the header and every field before it, before the front doors' own arguments
    assert rows.index(row) == len(dataclasses.fields(ExtendedConfig)) + 2


def test_every_argument_says_when_to_change_it():
    """The docs' table and the docstrings (LightningCLI's help) say when a user should change each argument."""
    from lightning_zeropp.config import when

    missing = [f.name for f in dataclasses.fields(ZeroPPConfig) if not when(f)]
    assert not missing, f"arguments without a `when=` text: {missing}"
    doc = _words(TrainerStrategy.__doc__)
    for f in dataclasses.fields(ZeroPPConfig):
        assert _words(f"Change it: {when(f)}") in doc, f.name


def test_the_docs_hold_the_generated_table():
    text = ARGUMENTS_PAGE.read_text()
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    assert text[start:end] == table(), f"{PAGE}: run `python -m lightning_zeropp.argument_table {PAGE}`"
    rows = table().splitlines()[3:-1]
    names = [row.split("`")[1] for row in rows]
    assert names == [f.name for f in dataclasses.fields(ZeroPPConfig)] + ["parallelize_fn"]


def test_write_table_replaces_only_the_table(tmp_path):
    page = tmp_path / "arguments.md"
    page.write_text(f"# Arguments\n\n{TABLE_START}\n| stale |\n{TABLE_END}\n\nText after.\n")
    assert write_table(page) is True
    assert page.read_text() == f"# Arguments\n\n{table()}\n\nText after.\n"
    assert write_table(page) is False  # already current


def test_write_table_refuses_a_page_without_the_markers(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("# A page without the table\n")
    with pytest.raises(ValueError, match=f"no generated table.*{PAGE}"):
        write_table(page)
    assert page.read_text() == "# A page without the table\n"


@pytest.mark.parametrize("strategy", FRONT_DOORS)
def test_from_config(strategy):
    config = ZeroPPConfig(weight_bits=4, gradient_pieces=3, ranks_per_node=2, state_dict_type="full")
    built = strategy.from_config(config)
    assert type(built) is strategy and built.zeropp_config == config and built.state_dict_type == "full"
    assert strategy.from_config(ZeroPPConfig()).zeropp_config == strategy().zeropp_config
    with pytest.raises(TypeError, match=r"from_config: `config` must be a ZeroPPConfig, got dict"):
        strategy.from_config({"weight_bits": 4})
    with pytest.raises(TypeError, match="multiple values for keyword argument 'weight_bits'"):
        strategy.from_config(config, weight_bits=8)


def test_fabric_from_config_takes_its_own_arguments():
    def parallelize(model, mesh):
        return model

    built = FabricStrategy.from_config(ZeroPPConfig(), parallelize_fn=parallelize)
    assert built._user_parallelize is parallelize


@pytest.mark.parametrize("strategy", FRONT_DOORS)
def test_pipeline_stages_is_a_deprecated_spelling_of_gradient_pieces(strategy):
    with pytest.deprecated_call(match="`pipeline_stages` is deprecated.*use `gradient_pieces`"):
        built = strategy(pipeline_stages=3)
    assert built.zeropp_config.gradient_pieces == 3
    assert not hasattr(built.zeropp_config, "pipeline_stages")
    with pytest.raises(ValueError, match=r"`pipeline_stages` is the deprecated spelling of `gradient_pieces`.*both"):
        strategy(pipeline_stages=3, gradient_pieces=4)
    with pytest.deprecated_call():  # with its new name at its default (as LightningCLI passes it), the old one counts
        assert strategy(pipeline_stages=3, gradient_pieces=2).zeropp_config.gradient_pieces == 3
    with pytest.deprecated_call(), pytest.raises(ValueError, match=r"`gradient_pieces=0`.*use 1 \(no overlap\)"):
        strategy(pipeline_stages=0)


@needs_cli
@pytest.mark.parametrize("strategy", [TrainerStrategy, FabricStrategy])
def test_deprecated_spellings_are_not_in_the_cli_help(strategy, monkeypatch):
    helps = _cli_help(strategy, monkeypatch)
    assert not set(RENAMED) & set(helps), sorted(set(RENAMED) & set(helps))
    assert "gradient_pieces" in helps and "auto_wrap_policy" in helps


def test_topology_is_not_exported():
    import lightning_zeropp

    assert not hasattr(lightning_zeropp, "Topology") and "Topology" not in lightning_zeropp.__all__


@pytest.mark.parametrize("strategy", FRONT_DOORS)
def test_help_title_is_a_whole_sentence(strategy):
    """LightningCLI's help title is the docstring's first line: a sentence of its own, not one cut mid-way."""
    first, second = strategy.__doc__.splitlines()[:2]
    assert first.startswith("ZeRO++") and first.endswith(".") and not second.strip(), (first, second)
