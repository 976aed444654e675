"""The parts of the readers' fuzzer, tests/fuzz_readers.py (the command
line, options and summary; its docstring describes the mutants and the
verdicts):

  runner           running kqsvd: environment, command lines, timeouts
  valid_set        the valid set, references and checkpoints every mutant starts from
  bytes_mutants    random byte edits of the HDF5 files (b*)
  h5_edits         h5py edits the structured mutants are made of
  struct_mutants   the catalogue of structured HDF5 mutants (s:*)
  manifest_mutants mangled manifests (m:*) and random edits of the manifest text (t*)
  recipes          every mutant's recipe, in a fixed order, and its description
  mutant           making one mutant in its folder, running and judging it
  verdict          sanitizer reports, judging a run, leftovers, --check-logs
"""
