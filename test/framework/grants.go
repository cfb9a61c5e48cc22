package framework

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	spokepkg "github.com/credbroker/credbroker/pkg/spoke"
)

// ClaimedGrants lists the grant Secrets in namespace ns of c that name a
// hub user: the grants of minted tokens, without the agent's pooled
// grants, to which no token is bound yet.
func (c *Cluster) ClaimedGrants(ctx context.Context, ns string) ([]corev1.Secret, error) {
	list, err := c.Client.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{LabelSelector: spokepkg.GrantLabelSelector})
	if err != nil {
		return nil, err
	}
	var claimed []corev1.Secret
	for _, g := range list.Items {
		if g.Annotations[spokepkg.GrantHubUserAnnotation] != "" {
			claimed = append(claimed, g)
		}
	}
	return claimed, nil
}
