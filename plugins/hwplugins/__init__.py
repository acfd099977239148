"""hwplugins: programs that run on a node and read only /sys, /dev and the kubelet sockets.

    api           our .proto files for the kubelet plugin APIs and their generated stubs
    deviceplugin  a reference device plugin: PCI devices in a (fake) sysfs -> extended resources

Nothing here imports ``sandbox``: a plugin must work unchanged on a real node.
"""
