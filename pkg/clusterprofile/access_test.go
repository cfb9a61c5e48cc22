package clusterprofile_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
)

func provider(name, server, ca string) v1alpha1.AccessProvider {
	p := v1alpha1.AccessProvider{Name: name, Cluster: clientcmdv1.Cluster{Server: server}}
	if ca != "" {
		p.Cluster.CertificateAuthorityData = []byte(ca)
	}
	return p
}

func TestAccess(t *testing.T) {
	withProviders := func(access, credential []v1alpha1.AccessProvider) *v1alpha1.ClusterProfile {
		cp := profile("fleet", "east-1")
		cp.Status.AccessProviders = access
		cp.Status.CredentialProviders = credential
		return cp
	}
	tests := []struct {
		name      string
		cp        *v1alpha1.ClusterProfile
		preferred string
		server    string
		ca        string
		ok        bool
	}{
		{
			name: "nil",
		},
		{
			name: "no providers",
			cp:   withProviders(nil, nil),
		},
		{
			name: "only empty servers",
			cp:   withProviders([]v1alpha1.AccessProvider{provider("a", "", "ca-a")}, []v1alpha1.AccessProvider{provider("b", "", "")}),
		},
		{
			name:   "first access provider",
			cp:     withProviders([]v1alpha1.AccessProvider{provider("a", "https://a", "ca-a"), provider("b", "https://b", "ca-b")}, nil),
			server: "https://a", ca: "ca-a", ok: true,
		},
		{
			name:   "first with a server",
			cp:     withProviders([]v1alpha1.AccessProvider{provider("a", "", "ca-a"), provider("b", "https://b", "ca-b")}, nil),
			server: "https://b", ca: "ca-b", ok: true,
		},
		{
			name:   "no CA",
			cp:     withProviders([]v1alpha1.AccessProvider{provider("a", "https://a", "")}, nil),
			server: "https://a", ok: true,
		},
		{
			name:      "preferred",
			cp:        withProviders([]v1alpha1.AccessProvider{provider("a", "https://a", "ca-a"), provider("b", "https://b", "ca-b")}, nil),
			preferred: "b",
			server:    "https://b", ca: "ca-b", ok: true,
		},
		{
			name:      "preferred missing",
			cp:        withProviders([]v1alpha1.AccessProvider{provider("a", "https://a", "ca-a")}, nil),
			preferred: "b",
			server:    "https://a", ca: "ca-a", ok: true,
		},
		{
			name:      "preferred without a server",
			cp:        withProviders([]v1alpha1.AccessProvider{provider("a", "https://a", "ca-a"), provider("b", "", "ca-b")}, nil),
			preferred: "b",
			server:    "https://a", ca: "ca-a", ok: true,
		},
		{
			name:   "deprecated credential providers only",
			cp:     withProviders(nil, []v1alpha1.AccessProvider{provider("a", "https://old-a", "ca-old")}),
			server: "https://old-a", ca: "ca-old", ok: true,
		},
		{
			name:   "access providers come first",
			cp:     withProviders([]v1alpha1.AccessProvider{provider("b", "https://b", "ca-b")}, []v1alpha1.AccessProvider{provider("a", "https://old-a", "ca-old")}),
			server: "https://b", ca: "ca-b", ok: true,
		},
		{
			name:      "preferred from credential providers",
			cp:        withProviders([]v1alpha1.AccessProvider{provider("b", "https://b", "ca-b")}, []v1alpha1.AccessProvider{provider("a", "https://old-a", "ca-old")}),
			preferred: "a",
			server:    "https://old-a", ca: "ca-old", ok: true,
		},
		{
			name:      "access provider wins a name clash",
			cp:        withProviders([]v1alpha1.AccessProvider{provider("a", "https://a", "ca-a")}, []v1alpha1.AccessProvider{provider("a", "https://old-a", "ca-old")}),
			preferred: "a",
			server:    "https://a", ca: "ca-a", ok: true,
		},
		{
			name: "access provider wins a name clash even without a server",
			cp: withProviders(
				[]v1alpha1.AccessProvider{provider("a", "", ""), provider("b", "https://b", "ca-b")},
				[]v1alpha1.AccessProvider{provider("a", "https://old-a", "ca-old")}),
			preferred: "a",
			server:    "https://b", ca: "ca-b", ok: true,
		},
		{
			name:   "clash without preference",
			cp:     withProviders([]v1alpha1.AccessProvider{provider("a", "", "")}, []v1alpha1.AccessProvider{provider("a", "https://old-a", "ca-old")}),
			server: "", ok: false,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			server, ca, ok := clusterprofile.Access(tt.cp, tt.preferred)
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.server, server)
			if tt.ca == "" {
				assert.Nil(t, ca)
			} else {
				assert.Equal(t, tt.ca, string(ca))
			}
		})
	}
}

func TestAccessCopiesCA(t *testing.T) {
	cp := profile("fleet", "east-1")
	cp.Status.AccessProviders = []v1alpha1.AccessProvider{provider("a", "https://a", "ca-a")}
	_, ca, ok := clusterprofile.Access(cp, "")
	assert.True(t, ok)
	ca[0] = 'X'
	assert.Equal(t, "ca-a", string(cp.Status.AccessProviders[0].Cluster.CertificateAuthorityData))
}
