"""A GPU rehearsal on a CPU build of torch: the package's CUDA branch run on fake CUDA tensors.

- ``shim.cpp`` / :mod:`.build`: a small C++ library, built at test time, that registers torch's
  own fake device guard and CUDA hooks, so that ``cuda`` FakeTensors work with autograd.
- :mod:`.run`: starts a process with the shim preloaded (parent side).
- :mod:`.rank`: inside that process, one rank of a GPU world: torch's fake process group
  (StarTrail's groups take NCCL's transport for CUDA tensors), FakeTensorMode, the kernel choice
  told it runs on an H100, and :class:`~.rank.DeviceRules` recording syncs, copies, mixed devices
  and the precision of merges, lse and sums.
- :mod:`.matrix`: the attention's rehearsal matrix (P, C, layout, rotation, regathering, kernel).

Nothing computes: shapes, dtypes, devices and the ops that would run are what is checked (and
memory, with torch's MemTracker). Numbers are the CPU tests' job.
"""
