"""Files and formats, numpy and h5py only: the contract's HDF5 files
(h5io.py), the projections file and its rank policies (projections.py),
and how every output is checked and written (files.py)."""
