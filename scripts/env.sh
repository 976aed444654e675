# Sourced by the scripts.  Lets Open MPI's mpirun run as root (containers,
# CI) and more ranks than cores (both no-ops for other MPIs and users), and
# picks a Python that has numpy and h5py: Debian's python3-* packages live
# under /usr/bin/python3, which need not be the python3 first on PATH.
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=${OMPI_MCA_rmaps_base_oversubscribe:-1}
if [ -z "${KQSVD_PYTHON:-}" ]; then
  for candidate in /usr/bin/python3 python3; do
    if "$candidate" -c "import numpy, h5py" 2>/dev/null; then
      KQSVD_PYTHON=$candidate
      break
    fi
  done
fi
export KQSVD_PYTHON=${KQSVD_PYTHON:-python3}
