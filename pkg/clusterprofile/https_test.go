package clusterprofile

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

func TestCheckHTTPS(t *testing.T) {
	tests := []struct {
		server  string
		wantErr []string
		notIn   string
	}{
		{server: "https://spoke.example:6443"},
		{server: "HTTPS://Spoke.Example"},
		{server: "https://127.0.0.1:6443/k8s/clusters/c-1"},
		{server: "http://spoke.example:6443", wantErr: []string{"fleet/prod", `"http://spoke.example:6443"`, "not an https URL", "cleartext", "status.accessProviders[name=credbroker].cluster.server"}},
		{server: "HTTP://spoke.example", wantErr: []string{`"HTTP://spoke.example"`}},
		{server: "spoke.example:6443", wantErr: []string{"not an https URL"}},
		{server: "https:spoke.example", wantErr: []string{"not an https URL"}},
		{server: "https://", wantErr: []string{"not a usable API server URL (it has no host)"}},
		{server: "ws://spoke.example", wantErr: []string{"not an https URL"}},
		{server: "http://u:secret@spoke.example", wantErr: []string{"http://u:xxxxx@spoke.example"}, notIn: "secret"},
		{server: "http://u:secret@spoke.example:https", wantErr: []string{"user information"}, notIn: "secret"},
		// What the publisher would not pin, the broker does not serve.
		{server: "https://u:secret@spoke.example", wantErr: []string{"https://u:xxxxx@spoke.example", "it has user information"}, notIn: "secret"},
		{server: "https://spoke.example?x=1", wantErr: []string{"it has a query"}},
		{server: "https://spoke.example#frag", wantErr: []string{"it has a fragment"}},
		{server: "https://spoke.example#", wantErr: []string{"it has a fragment"}},
		{server: "https://:6443", wantErr: []string{"it has no host"}},
		{server: "https://spoke.example:0", wantErr: []string{"invalid port"}},
	}
	for _, tt := range tests {
		t.Run(tt.server, func(t *testing.T) {
			err := checkHTTPS("fleet", "prod", "credbroker", tt.server)
			if tt.wantErr == nil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, errdefs.ErrFailedPrecondition)
			for _, s := range tt.wantErr {
				assert.Contains(t, err.Error(), s)
			}
			if tt.notIn != "" {
				assert.NotContains(t, err.Error(), tt.notIn)
			}
		})
	}
}
