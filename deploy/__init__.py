"""The deployment files fedmeta runs itself, installed as package data ``fedmeta.deploy``.

``tls/make-certs.sh`` (with ``tls/register-nodes.sh``, which it calls) and
``proxy/fleet-only.conf.template`` are used by ``fedmeta deploy local`` from an installed wheel as
well as from a checkout; they are found through ``importlib.resources`` on this package. The other
files here (compose overlays, images, Prometheus, Grafana) are used from a checkout only. No Python
code lives in this package.
"""
