package cmdflags

import (
	"time"

	"github.com/spf13/pflag"
)

// Fields adds flags that set the fields of a Config, each defaulting to
// the value its field holds when the flag is added: the value of the
// package's Default(), which so states each default once.
type Fields struct{ FlagSet *pflag.FlagSet }

func (f Fields) Duration(p *time.Duration, name, usage string) {
	f.FlagSet.DurationVar(p, name, *p, usage)
}
func (f Fields) Int(p *int, name, usage string)         { f.FlagSet.IntVar(p, name, *p, usage) }
func (f Fields) Float64(p *float64, name, usage string) { f.FlagSet.Float64Var(p, name, *p, usage) }
func (f Fields) String(p *string, name, usage string)   { f.FlagSet.StringVar(p, name, *p, usage) }
func (f Fields) Bool(p *bool, name, usage string)       { f.FlagSet.BoolVar(p, name, *p, usage) }

// Float32 adds a flag of a finite float32 (see the function Float32).
func (f Fields) Float32(p *float32, name, usage string) { f.FlagSet.Var(Float32(p), name, usage) }
