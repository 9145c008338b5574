"""How examples become batches, and in which order: packing (`sample_packing`, `eval_sample_packing`,
`sample_packing_sequentially`), padding to a fixed length (`pad_to_sequence_len`), HF's length-grouped order
(`group_by_length`) and Axolotl's data order (`shuffle_merged_datasets`, `curriculum_sampling`). data/ and the SFT
loop act on them."""

from __future__ import annotations

from pydantic import PrivateAttr

from hanzo_gym.config.feature import Feature


class BatchingKeys(Feature):
    sample_packing: bool = False
    eval_sample_packing: bool | None = None  # None: as sample_packing (Axolotl's rule)
    pad_to_sequence_len: bool = False  # each SFT row padded to sequence_len tokens (fixed shapes)
    group_by_length: bool = False  # HF's length-grouped order: mega-batches sorted by length
    # Axolotl's data order: the merged datasets shuffled at load (false: in config and file order), each epoch in
    # that order rather than shuffled (curriculum_sampling), samples packed in order (sample_packing_sequentially,
    # which is how hanzo-gym packs anyway)
    shuffle_merged_datasets: bool = True
    curriculum_sampling: bool = False
    sample_packing_sequentially: bool = False

    _unused_batching: list[str] = PrivateAttr(default_factory=list)

    @property
    def shuffles_at_load(self) -> bool:
        """Axolotl's merge: the rows shuffled with the seed once loaded (before the validation split), unless
        shuffle_merged_datasets is false, or curriculum_sampling is on with a single dataset."""
        single_in_order = self.curriculum_sampling and len(self.datasets) == 1
        return self.shuffle_merged_datasets and not single_in_order

    def check(self) -> None:
        if self.pad_to_sequence_len and self.rl is not None:  # Axolotl's preference trainers ignore it too
            self.pad_to_sequence_len = False
            self._unused_batching.append(
                f"pad_to_sequence_len: changes nothing here: it pads SFT batches, and rl: {self.rl} forms its own "
                "(pairs or rollouts)"
            )
        if self.eval_sample_packing and not self.sample_packing:
            raise ValueError(
                "eval_sample_packing: true packs the eval set only together with sample_packing: true (Axolotl's "
                "rule); set sample_packing: true or remove eval_sample_packing"
            )
        if self.sample_packing_sequentially and not self.sample_packing:
            raise ValueError(
                "sample_packing_sequentially packs samples in order; without sample_packing: true nothing is "
                "packed: set it or remove sample_packing_sequentially"
            )
        if self.curriculum_sampling:
            if self.rl is not None:
                raise ValueError(
                    f"curriculum_sampling orders SFT examples (Axolotl's SFT sampler); rl: {self.rl} does not use "
                    "it: remove it"
                )
            if self.group_by_length:
                raise ValueError(
                    "curriculum_sampling keeps the data's order and group_by_length reorders it by length; give one"
                )
        if self.group_by_length:
            if self.rl is not None:
                raise ValueError(
                    f"group_by_length orders SFT examples; rl: {self.rl} does not use it: remove it"
                )
            if self.sample_packing:  # Axolotl's multipack sampler replaces the length-grouped one
                self.group_by_length = False
                self._unused_batching.append(
                    "group_by_length: changes nothing here: with sample_packing the packer forms the rows, so "
                    "there is nothing to group by length (Axolotl's multipack sampler does the same)"
                )

    def notes(self) -> list[str]:
        return list(self._unused_batching)
