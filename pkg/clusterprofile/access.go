package clusterprofile

import (
	"bytes"

	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
)

// Access returns the API server URL and CA bundle of the cluster cp stands
// for, read from cp.Status.AccessProviders and the deprecated
// cp.Status.CredentialProviders. When both lists name the same provider, the
// one in AccessProviders is used; within a list the first entry of a name
// wins.
//
// Access picks the provider named preferred when there is one with a
// non-empty server; otherwise the first provider, AccessProviders before
// CredentialProviders and each in list order, with a non-empty server. ok is
// false when no provider has a server. caData is a copy and is nil when the
// provider has none; a CA given as a file path (certificate-authority) is
// ignored, since such a path means nothing on the hub.
func Access(cp *v1alpha1.ClusterProfile, preferred string) (server string, caData []byte, ok bool) {
	server, caData, ok = accessOf(cp, preferred)
	return server, bytes.Clone(caData), ok
}

// accessOf is Access without the copy: caData is cp's own.
func accessOf(cp *v1alpha1.ClusterProfile, preferred string) (server string, caData []byte, ok bool) {
	if cp == nil {
		return "", nil, false
	}
	lists := [][]v1alpha1.AccessProvider{cp.Status.AccessProviders, cp.Status.CredentialProviders}
	seen := map[string]bool{}
	var first *v1alpha1.AccessProvider
	for _, list := range lists {
		for k := range list {
			p := &list[k]
			if seen[p.Name] {
				continue
			}
			seen[p.Name] = true
			if p.Cluster.Server == "" {
				continue
			}
			if preferred != "" && p.Name == preferred {
				return p.Cluster.Server, p.Cluster.CertificateAuthorityData, true
			}
			if first == nil {
				first = p
			}
		}
	}
	if first == nil {
		return "", nil, false
	}
	return first.Cluster.Server, first.Cluster.CertificateAuthorityData, true
}
