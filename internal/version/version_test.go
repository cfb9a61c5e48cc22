package version

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestGet(t *testing.T) {
	vcs := func(rev, modified string) *debug.BuildInfo {
		return &debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Version: "v0.2.0"}, Settings: []debug.BuildSetting{
			{Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified},
		}}
	}
	tests := []struct {
		name     string
		version  string
		revision string
		bi       *debug.BuildInfo
		want     string
	}{
		{name: "linker values win", version: "v0.1.0", revision: "abc-dirty", bi: vcs("def", "false"), want: "v0.1.0 (revision abc-dirty, go1.26.0)"},
		{name: "build info", bi: vcs("def", "false"), want: "v0.2.0 (revision def, go1.26.0)"},
		{name: "build info of a modified tree", bi: vcs("def", "true"), want: "v0.2.0 (revision def-dirty, go1.26.0)"},
		{name: "linker version, build info revision", version: "v0.1.0", bi: vcs("def", "true"), want: "v0.1.0 (revision def-dirty, go1.26.0)"},
		{name: "nothing recorded", bi: &debug.BuildInfo{GoVersion: "go1.26.0"}, want: "(devel) (revision unknown, go1.26.0)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, get(tt.version, tt.revision, tt.bi).String())
		})
	}
}
