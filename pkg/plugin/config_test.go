package plugin_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/pkg/plugin"
)

func TestParseReference(t *testing.T) {
	tests := []struct {
		in      string
		want    plugin.Reference
		wantErr string
	}{
		{in: "fleet/prod-eu-1", want: plugin.Reference{Namespace: "fleet", Name: "prod-eu-1"}},
		{in: "a/b.c-d", want: plugin.Reference{Namespace: "a", Name: "b.c-d"}},
		{in: "", wantErr: "not of the form <namespace>/<name>"},
		{in: "prod-eu-1", wantErr: "not of the form <namespace>/<name>"},
		{in: "/prod", wantErr: "namespace is required"},
		{in: "fleet/", wantErr: "name is required"},
		{in: "fleet/prod/x", wantErr: `name "prod/x" is invalid`},
		{in: "Fleet/prod", wantErr: `namespace "Fleet" is invalid`},
		{in: "fleet.x/prod", wantErr: `namespace "fleet.x" is invalid`},
		{in: strings.Repeat("a", 64) + "/prod", wantErr: "namespace"},
		{in: "fleet/" + strings.Repeat("a", 254), wantErr: "name"},
		{in: " fleet/prod", wantErr: "namespace"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := plugin.ParseReference(tt.in)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
			assert.Equal(t, tt.in, got.String())
		})
	}
}

func TestParseExecConfig(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    plugin.Reference
		wantErr string
	}{
		{name: "valid", in: `{"clusterProfile":{"namespace":"fleet","name":"prod-eu-1"}}`, want: plugin.Reference{Namespace: "fleet", Name: "prod-eu-1"}},
		{name: "white space", in: " \n{ \"clusterProfile\" : { \"name\":\"p\", \"namespace\":\"f\" } }\n", want: plugin.Reference{Namespace: "f", Name: "p"}},
		{name: "empty", in: "", wantErr: "exec config is empty"},
		{name: "blank", in: " \t\n", wantErr: "exec config is empty"},
		{name: "null", in: "null", wantErr: "exec config is empty"},
		{name: "array", in: `[{"clusterProfile":{}}]`, wantErr: "not a JSON object"},
		{name: "string", in: `"fleet/prod"`, wantErr: "not a JSON object"},
		{name: "empty object", in: `{}`, wantErr: "has no clusterProfile"},
		{name: "null clusterProfile", in: `{"clusterProfile":null}`, wantErr: "has no clusterProfile"},
		{name: "flat reference", in: `{"namespace":"fleet","name":"prod"}`, wantErr: `unknown field "namespace"`},
		{name: "wrong case", in: `{"ClusterProfile":{"namespace":"fleet","name":"prod"}}`, wantErr: `unknown field "ClusterProfile"`},
		{name: "unknown nested field", in: `{"clusterProfile":{"namespace":"fleet","name":"prod","kind":"ClusterProfile"}}`, wantErr: `unknown field "clusterProfile.kind"`},
		{name: "duplicate field", in: `{"clusterProfile":{"namespace":"fleet","name":"prod","name":"other"}}`, wantErr: `duplicate field "clusterProfile.name"`},
		{name: "clusterProfile as string", in: `{"clusterProfile":"fleet/prod"}`, wantErr: "cannot unmarshal string"},
		{name: "missing name", in: `{"clusterProfile":{"namespace":"fleet"}}`, wantErr: "clusterProfile: name is required"},
		{name: "bad namespace", in: `{"clusterProfile":{"namespace":"Fleet","name":"prod"}}`, wantErr: `namespace "Fleet" is invalid`},
		{name: "trailing data", in: `{"clusterProfile":{"namespace":"fleet","name":"prod"}} {}`, wantErr: "exec config"},
		{name: "truncated", in: `{"clusterProfile":{"namespace":"fleet"`, wantErr: "exec config"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := plugin.ParseExecConfig([]byte(tt.in))
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				assert.Equal(t, plugin.ExecConfig{}, got)
				return
			}
			require.NoError(t, err)
			require.NotNil(t, got.ClusterProfile)
			assert.Equal(t, tt.want, *got.ClusterProfile)
		})
	}
}

func FuzzParseReference(f *testing.F) {
	for _, s := range []string{"fleet/prod-eu-1", "a/b.c", "", "/", "a/", "/b", "a/b/c", "A/b", "a/B", "a\x00/b", "ü/b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := plugin.ParseReference(s)
		if err != nil {
			assert.Equal(t, plugin.Reference{}, r)
			return
		}
		require.NoError(t, r.Validate())
		require.Equal(t, s, r.String())
		again, err := plugin.ParseReference(r.String())
		require.NoError(t, err)
		require.Equal(t, r, again)
	})
}

func FuzzParseExecConfig(f *testing.F) {
	for _, s := range []string{
		`{"clusterProfile":{"namespace":"fleet","name":"prod-eu-1"}}`,
		`{"clusterProfile":{"namespace":"fleet","name":"prod","name":"x"}}`,
		`{"clusterProfile":null}`, `{}`, `null`, ``, `[]`, `"x"`, `1`,
		`{"namespace":"fleet","name":"prod"}`,
		`{"clusterProfile":{"namespace":"fleet"`,
		`{"clusterProfile":{"namespace":"fleet","name":"prod"}} {}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		c, err := plugin.ParseExecConfig(raw)
		if err != nil {
			assert.Equal(t, plugin.ExecConfig{}, c)
			return
		}
		require.NotNil(t, c.ClusterProfile)
		require.NoError(t, c.ClusterProfile.Validate())
		// What parses re-encodes to something that parses to the same value.
		b, err := json.Marshal(c)
		require.NoError(t, err)
		again, err := plugin.ParseExecConfig(b)
		require.NoError(t, err)
		require.Equal(t, c, again)
	})
}
