"""Topology pictures for workshops: nodes, NUMA nodes, CPUs, PCI tree, devices, health,
allocations, and what each node's kubelet advertises.

``topology_svg(nodes, views, live=..., cpus=held)`` returns a standalone SVG document (no
external fonts or scripts): per node its Ready state and a table of the extended
resources its kubelet advertises (capacity, allocatable, healthy per NUMA node), per NUMA
node its CPUs (held exclusively by a container: orange) and devices with their live
health, reason, holder and SR-IOV VF count. ``claims_svg(usage)`` draws ``sandbox dra
claims``: which pod's claim holds which partition or NIC share, and what is left of each
GPU's counters and NIC's capacity. ``svg_to_png`` rasterises either with ``rsvg-convert``
(Debian: librsvg2-bin).

Made for a projector: the topology is a 16:9 frame (a slide) with the nodes packed in rows
in the profile's order, the row breaks chosen so that the frame shows them largest; user
units are pixels at scale 1, where no text is smaller than 13 px (12 px in the claims
picture); ``scale`` (``--scale``) sets the output size, by default as large as fits
1920x1080 and never below 1. Texts are placed from their measured widths (DejaVu Sans,
the font fonts-dejavu-core gives librsvg), so no two meet and each stays inside its box;
one too long for the widest box is cut with "…".
Each drawn device carries ``data-device``/``data-numa``/``data-health`` (``data-vfs``:
VFs per physical function), each advertised resource ``data-resource``/
``data-capacity``/``data-allocatable`` (a held CPU ``data-cpu``/``data-held``), so
tests and tools can check what the picture shows without parsing its geometry.
"""

from sandbox.draw.claims import claims_svg
from sandbox.draw.png import svg_to_png
from sandbox.draw.svg import fit_scale, text_width
from sandbox.draw.topology import topology_svg
from sandbox.draw.views import DeviceView, NodeView, ResourceView, vf_counts

__all__ = [
    "DeviceView", "NodeView", "ResourceView", "claims_svg", "fit_scale", "svg_to_png",
    "text_width", "topology_svg", "vf_counts",
]
