package serverurl

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCheck(t *testing.T) {
	tests := []struct {
		server  string
		wantErr string
	}{
		{server: "https://spoke.example:6443"},
		{server: "https://spoke.example"},
		{server: "https://spoke.example:6443/"},
		{server: "https://10.0.0.1:6443/clusters/fleet/prod"},
		{server: "https://[::1]:6443"},
		{server: "https://[2001:DB8::1]"},
		{server: "https://az.AZ-09_x.example:65535"},
		// Schemes are case-insensitive, and so are hosts.
		{server: "HTTPS://h"},
		{server: "HTTPS://Spoke.Example:6443"},
		{server: "Https://spoke.example"},
		{server: "", wantErr: "empty"},
		{server: "http://spoke.example:6443", wantErr: "not an https URL"},
		{server: "HTTP://spoke.example", wantErr: "not an https URL"},
		{server: "ws://spoke.example", wantErr: "not an https URL"},
		{server: "spoke.example:6443", wantErr: "not an https URL"},
		{server: "//spoke.example:6443", wantErr: "not an https URL"},
		{server: "https:spoke.example", wantErr: "not an https URL"},
		{server: "unix:///var/run/spoke.sock", wantErr: "not an https URL"},
		{server: "127.0.0.1:6443", wantErr: "not a URL"},
		{server: "https://spoke.example:6443\n", wantErr: "not a URL"},
		{server: "https://spoke.example:https", wantErr: "not a URL"},
		{server: "https://[::1%eth0]", wantErr: "not a URL"},
		{server: "https://user:secret@spoke.example", wantErr: "user information"},
		{server: "https://user@spoke.example", wantErr: "user information"},
		{server: "https://@spoke.example", wantErr: "user information"},
		{server: "https://spoke.example?x=1", wantErr: "query"},
		{server: "https://spoke.example?", wantErr: "query"},
		{server: "https://spoke.example/?", wantErr: "query"},
		{server: "https://spoke.example#frag", wantErr: "fragment"},
		{server: "https://spoke.example/#frag", wantErr: "fragment"},
		{server: "https://spoke.example#", wantErr: "fragment"},
		{server: "https://", wantErr: "no host"},
		{server: "https://:6443", wantErr: "no host"},
		{server: "https:///path", wantErr: "no host"},
		{server: "https://spoke.example:", wantErr: "empty port"},
		{server: "https://spoke.example:0", wantErr: "invalid port"},
		{server: "https://spoke.example:65536", wantErr: "invalid port"},
		{server: "https://[fe80::1%25eth0]:6443", wantErr: "IPv6 zone"},
		{server: "https://%25", wantErr: "neither an IP address nor a DNS name"},
		{server: "https://spök.example", wantErr: "neither an IP address nor a DNS name"},
	}
	for _, tt := range tests {
		t.Run(tt.server, func(t *testing.T) {
			err := Check(tt.server)
			assert.Equal(t, tt.wantErr == "", Valid(tt.server))
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.wantErr)
			assert.Equal(t, tt.wantErr == "not an https URL", errors.Is(err, ErrNotHTTPS))
			assert.NotContains(t, err.Error(), "secret", "the reason quotes nothing of the URL")
		})
	}
}

func TestRedacted(t *testing.T) {
	tests := []struct {
		raw  string
		want string
	}{
		{raw: "https://spoke.example:6443", want: "https://spoke.example:6443"},
		{raw: "HTTPS://Spoke.Example", want: "HTTPS://Spoke.Example"},
		{raw: "not a url\n", want: "not a url\n"},
		{raw: "https://u:secret@spoke.example", want: "https://u:xxxxx@spoke.example"},
		{raw: "http://u@spoke.example", want: "http://u@spoke.example"},
		{raw: "http://u:secret@spoke.example:https", want: "(a URL with user information)"},
		{raw: "https://spoke.example/?token=u:secret@x", want: "(a URL with user information)"},
	}
	for _, tt := range tests {
		t.Run(tt.raw, func(t *testing.T) {
			assert.Equal(t, tt.want, Redacted(tt.raw))
		})
	}
}
