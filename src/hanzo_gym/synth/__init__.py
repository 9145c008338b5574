"""`gym synth`: build a dataset from a design of sampler, expression and LLM columns, with validators.

`load_design` parses and checks the YAML; `synthesize` runs it (preview in memory, or into `output`, resuming).
"""

from hanzo_gym.synth.design import Design, load_design, parse_design
from hanzo_gym.synth.run import SynthReport, SynthShortfall, synthesize

__all__ = ["Design", "SynthReport", "SynthShortfall", "load_design", "parse_design", "synthesize"]
