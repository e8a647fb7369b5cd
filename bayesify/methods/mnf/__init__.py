"""MNF: multiplicative normalizing flows for variational BNNs (Louizos & Welling 2017)."""

from bayesify.methods.mnf.bound import InverseModel, node_prior_kl, node_view
from bayesify.methods.mnf.config import MNFConfig
from bayesify.methods.mnf.flows import Coupling, CouplingFlow
from bayesify.methods.mnf.layers import MNFLayer
from bayesify.methods.mnf.method import MNFMethod

__all__ = ["Coupling", "CouplingFlow", "InverseModel", "MNFConfig", "MNFLayer", "MNFMethod",
           "node_prior_kl", "node_view"]
