"""prefixflow: offline batch LLM inference that plans the whole job before running it.

The subpackages live in the repository's top-level folders (pipeline/, engine/, kernels/,
operators/, jobs/, bench/) and install as `prefixflow.<folder>`.
"""

__version__ = "0.1.0"
