"""hwplugins: programs that run on a node and read only /sys, /dev and the kubelet sockets.

    api           our .proto files for the kubelet plugin APIs and their generated stubs
    sysfs         the one reader of a root's files: unbuffered os-level reads, absent = None
    devices       the one device model: ``scan(root)`` -> typed PciDevice records (nodes, health)
    watch         when to rescan: a period, or a live tree's change events
    kubeletsock   our sockets in the kubelet's directories: served, served and registered again
    deviceplugin  a reference device plugin: devices -> extended resources
    dra           a reference DRA driver: devices -> ResourceSlices, and a kubelet plugin

Nothing here imports ``sandbox``: a plugin must work unchanged on a real node.
"""
