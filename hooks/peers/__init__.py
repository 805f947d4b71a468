"""Import peers' dumps into bundles: msprobe (MindStudio Probe) PyTorch dumps and Polygraphy run
results. Tensor files are read only by loaders that cannot run code (torch's ``weights_only``
loader, ``numpy.load(allow_pickle=False)``); anything else is refused with a clear message."""

from hooks.peers.msprobe import import_msprobe
from hooks.peers.polygraphy import import_polygraphy
from hooks.peers.safeload import PeerDumpError

__all__ = ["PeerDumpError", "import_msprobe", "import_polygraphy"]
