package plugin

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

func TestCanonicalServer(t *testing.T) {
	tests := []struct {
		in      string
		want    string
		wantErr string
	}{
		{in: "https://spoke.example:6443", want: "https://spoke.example:6443"},
		{in: "https://spoke.example:6443/", want: "https://spoke.example:6443"},
		{in: "https://spoke.example:6443//", want: "https://spoke.example:6443"},
		{in: "HTTPS://Spoke.EXAMPLE:6443", want: "https://spoke.example:6443"},
		{in: "https://spoke.example", want: "https://spoke.example:443"},
		{in: "https://spoke.example:443/", want: "https://spoke.example:443"},
		{in: "https://spoke.example:0443", want: "https://spoke.example:443"},
		{in: "https://127.0.0.1:6443", want: "https://127.0.0.1:6443"},
		{in: "https://[::1]:6443", want: "https://[::1]:6443"},
		{in: "https://[0:0:0:0:0:0:0:1]:6443/", want: "https://[::1]:6443"},
		{in: "https://[2001:DB8::1]", want: "https://[2001:db8::1]:443"},
		{in: "https://spoke.example/k8s/clusters/c-1/", want: "https://spoke.example:443/k8s/clusters/c-1"},
		{in: "https://spoke.example/K8s/Clusters", want: "https://spoke.example:443/K8s/Clusters"},
		{in: "https://spoke.example/a%2Fb", want: "https://spoke.example:443/a%2Fb"},
		// Every end of the ranges of a DNS name's characters.
		{in: "https://az.AZ-09_x.example", want: "https://az.az-09_x.example:443"},
		{in: "", wantErr: "empty"},
		{in: "spoke.example:6443", wantErr: "not an https URL"},
		{in: "127.0.0.1:6443", wantErr: "not a URL"},
		{in: "//spoke.example:6443", wantErr: "not an https URL"},
		{in: "ftp://spoke.example", wantErr: "not an https URL"},
		{in: "https:spoke.example", wantErr: "not an https URL"},
		{in: "https://", wantErr: "no host"},
		{in: "https://:6443", wantErr: "no host"},
		{in: "https://spoke.example:", wantErr: "empty port"},
		{in: "https://spoke.example:0", wantErr: "invalid port"},
		{in: "https://spoke.example:65536", wantErr: "invalid port"},
		{in: "https://spoke.example:https", wantErr: "not a URL"},
		{in: "https://user:secret@spoke.example", wantErr: "user information"},
		{in: "https://spoke.example?x=1", wantErr: "query"},
		{in: "https://spoke.example/?", wantErr: "query"},
		{in: "https://spoke.example/#frag", wantErr: "fragment"},
		{in: "https://spoke.example#", wantErr: "fragment"},
		{in: "https://[::1%eth0]", wantErr: "not a URL"},
		{in: "https://[spoke.example]", wantErr: "not a URL"},
		{in: "https://[fe80::1%25eth0]:6443", wantErr: "IPv6 zone"},
		{in: "https://%25", wantErr: "neither an IP address nor a DNS name"},
		// client-go sends the token over http too, in cleartext.
		{in: "http://spoke.example", wantErr: "not an https URL"},
		{in: "http://spoke.example:443", wantErr: "not an https URL"},
		{in: "HTTP://spoke.example:6443", wantErr: "not an https URL"},
		{in: "ws://spoke.example", wantErr: "not an https URL"},
		{in: "https://spök.example", wantErr: "neither an IP address nor a DNS name"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := canonicalServer(tt.in)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				assert.NotContains(t, err.Error(), "secret")
				assert.Empty(t, got)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
			again, err := canonicalServer(got)
			require.NoError(t, err)
			assert.Equal(t, got, again, "the canonical form is its own canonical form")
		})
	}
}

func TestSameServer(t *testing.T) {
	prod := Reference{Namespace: "fleet", Name: "prod"}
	tests := []struct {
		name          string
		exec, broker  string
		wantErr       []string
		wantNotInErrs []string
	}{
		{name: "equal", exec: "https://prod.example:6443", broker: "https://prod.example:6443"},
		{name: "equivalent", exec: "HTTPS://Prod.Example/", broker: "https://prod.example:443"},
		{
			name: "other host", exec: "https://attacker.example", broker: "https://prod.example:6443",
			wantErr: []string{"fleet/prod", "https://attacker.example", "https://prod.example:6443", "permission denied"},
		},
		{
			name: "other scheme", exec: "http://prod.example:6443", broker: "https://prod.example:6443",
			wantErr: []string{"http://prod.example:6443", "not an https URL"},
		},
		{
			name: "both plain http", exec: "http://prod.example:6443", broker: "http://prod.example:6443",
			wantErr: []string{"http://prod.example:6443", "not an https URL"},
		},
		{
			name: "broker has none", exec: "https://prod.example:6443", broker: "",
			wantErr: []string{"fleet/prod", "returned no server", "https://prod.example:6443"},
		},
		{
			name: "broker's is unusable", exec: "https://prod.example:6443", broker: "prod.example:6443",
			wantErr: []string{"prod.example:6443", "from the broker, is unusable"},
		},
		{
			name: "exec info's is unusable", exec: "https://u:secret@prod.example:6443", broker: "https://prod.example:6443",
			wantErr:       []string{"https://u:xxxxx@prod.example:6443", "user information"},
			wantNotInErrs: []string{"secret"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := sameServer(prod, tt.exec, tt.broker)
			if tt.wantErr == nil {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.ErrorIs(t, err, errdefs.ErrPermissionDenied)
			for _, s := range tt.wantErr {
				assert.Contains(t, err.Error(), s)
			}
			for _, s := range tt.wantNotInErrs {
				assert.NotContains(t, err.Error(), s)
			}
		})
	}
}

func TestIsHost(t *testing.T) {
	tests := []struct {
		server, name string
		want         bool
	}{
		{server: "https://spoke.example:6443", name: "spoke.example", want: true},
		{server: "https://Spoke.Example:6443/", name: "SPOKE.example", want: true},
		{server: "https://127.0.0.1:6443", name: "127.0.0.1", want: true},
		{server: "https://[::1]:6443", name: "0:0:0:0:0:0:0:1", want: true},
		{server: "https://spoke.example:6443", name: "attacker.example"},
		{server: "https://spoke.example:6443", name: "spoke.example:6443"},
		{server: "https://spoke.example:6443", name: "spoke.example."},
		{server: "https://127.0.0.1:6443", name: "127.0.0.2"},
		{server: "https://127.0.0.1:6443", name: "localhost"},
		{server: "https://", name: ""},
		{server: "https://%zz", name: "%zz"},
	}
	for _, tt := range tests {
		t.Run(tt.server+" "+tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, isHost(tt.server, tt.name))
		})
	}
}

func TestSameCA(t *testing.T) {
	prod := Reference{Namespace: "fleet", Name: "prod"}
	const pemA = "-----BEGIN CERTIFICATE-----\nQUFBQQ==\n-----END CERTIFICATE-----\n"
	const pemB = "-----BEGIN CERTIFICATE-----\nQkJCQg==\n-----END CERTIFICATE-----\n"
	tests := []struct {
		name         string
		exec, broker string
		wantErr      []string
	}{
		{name: "both none"},
		{name: "equal", exec: pemA, broker: pemA},
		{name: "equal but for surrounding white space", exec: "  " + pemA + "\n\n", broker: pemA[:len(pemA)-1]},
		{name: "white space only is none", exec: " \n", broker: ""},
		{name: "other", exec: pemB, broker: pemA, wantErr: []string{"fleet/prod", "62 bytes with SHA-256 ", "certificate-authority-data"}},
		{name: "exec only", exec: pemB, wantErr: []string{"none (the system roots)"}},
		{name: "broker only", broker: pemA, wantErr: []string{"is none (the system roots), and the cluster's is 62 bytes"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := sameCA(prod, "https://prod.example", []byte(tt.exec), []byte(tt.broker))
			if tt.wantErr == nil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, errdefs.ErrPermissionDenied)
			for _, s := range tt.wantErr {
				assert.Contains(t, err.Error(), s)
			}
			assert.NotContains(t, err.Error(), "QUFBQQ")
			assert.NotContains(t, err.Error(), "QkJCQg")
		})
	}
}

// FuzzCanonicalServer checks that canonicalServer never panics, that its
// result is its own canonical form, and that two URLs it calls equal stay
// equal: a URL and its canonical form name the same server.
func FuzzCanonicalServer(f *testing.F) {
	for _, s := range []string{
		"https://spoke.example:6443", "HTTPS://Spoke.Example:6443/", "http://h", "https://[::1]:6443",
		"https://[fe80::1%25eth0]:6443", "https://h/a%2Fb/", "https://u:p@h", "https://h?x", "https://h#f",
		"h:6443", "", "https://", "https://h:", "https://h:99999", "https://[h]", "https://h/\x00",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		c, err := canonicalServer(s)
		if err != nil {
			require.Empty(t, c)
			return
		}
		again, err := canonicalServer(c)
		require.NoError(t, err, "canonical form %q of %q", c, s)
		require.Equal(t, c, again, "canonical form of %q", s)
		require.NoError(t, sameServer(Reference{Namespace: "a", Name: "b"}, s, c))
	})
}
